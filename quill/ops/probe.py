"""The machine's read bandwidth, measured by the native library's probe (csrc/probe.cpp).

Decode is bound by memory, so each kernel is judged by the fraction of this rate it reaches:
the benchmarks print a kernel's achieved GB/s beside the probe's, with one thread and with all.
The buffer is far larger than the last-level cache and on huge pages, as the KV cache is. A
sequential read is the machine's ceiling; scattered reads of a cache block's size (a paged
cache's pattern, prefetched as the kernel does) show what that pattern itself allows.
"""

from __future__ import annotations

import torch

from quill.ops import library, memory


def read_bandwidth(
    threads: int | None = None, size: int = 512 << 20, repeats: int = 5, chunk_bytes: int = 0
) -> float:
    """Bytes per second one read of `size` bytes reaches, best of `repeats`, with one thread
    (threads=1) or all of torch's (None); sequential, or (chunk_bytes > 0) in scattered chunks
    of that size, as a paged KV cache's blocks are read."""
    if library.load() is None:
        raise RuntimeError("the bandwidth probe needs the native library (`make setup`)")
    buffer = memory.zeros((size // 4,), torch.float32, torch.device("cpu"))
    buffer.fill_(1.0)  # commit every page before timing
    threads = torch.get_num_threads() if threads is None else threads
    best_seconds = torch.ops.quill.read_probe(buffer, threads, repeats, chunk_bytes)[0].item()
    read = size if not chunk_bytes else size // chunk_bytes * chunk_bytes
    return read / best_seconds
