"""Large CPU tensors on transparent huge pages: the KV cache and the bandwidth probe's buffer.

Decode attention reads 16-token blocks scattered over the whole KV pool, and on a virtual
machine every TLB miss walks two page tables: on the Zen 4 here a plain read of 256 MiB ran at
20-27 GB/s on 4 KiB pages against 28-34 on 2 MiB pages in one run (equal, 22 GB/s, in another:
the VM's bandwidth drifts), and the attention kernel 6-8% faster interleaved. torch's CPU
allocator asks for huge pages only when `THP_MEM_ALLOC_ENABLE=1` is set before it first
allocates, which quill cannot promise, so these tensors are mapped here instead: anonymous
memory advised `MADV_HUGEPAGE` (the kernel's `madvise` mode, the common default). Every page is
written once here, at allocation: with the kernel's default `defrag=madvise` the first touch of
a huge page may compact memory first (2.3 s per GiB measured on a fresh VM, 0.1-0.7 s later,
against 0.4 s for small pages), a stall that must happen at start-up, never in a step that
takes a fresh block. Elsewhere (no `madvise`, or a GPU) these are plain `torch.zeros`.
"""

from __future__ import annotations

import ctypes
import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor; on a CPU with transparent huge pages, backed by them."""
    numel = math.prod(shape)
    advise = getattr(mmap, "MADV_HUGEPAGE", None)
    if device.type != "cpu" or advise is None or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = -(-numel * dtype.itemsize // HUGE_PAGE) * HUGE_PAGE
    # One huge page more, to start the tensor on a huge-page boundary.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        region.madvise(advise)
    except OSError:
        pass  # huge pages off ("never"): still a zeroed tensor
    view = ctypes.c_char.from_buffer(region)
    offset = -ctypes.addressof(view) % HUGE_PAGE
    del view  # a live export would keep the mapping from ever closing
    # The tensor keeps the mapping alive; it is unmapped when the last view goes.
    tensor = torch.frombuffer(region, dtype=dtype, count=numel, offset=offset).view(shape)
    return tensor.zero_()  # commit every page now (already zero: this only faults them in)


def return_freed_memory() -> None:
    """Hand the C heap's free pages back to the system (glibc's malloc_trim): loading frees
    gigabytes of decoded copies in pieces too small for their pages to go back by themselves
    (a Q8_0 1B file: 1.5 GB held after loading without this)."""
    import ctypes.util

    try:
        ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: its allocator decides
