"""The machine's read bandwidth, measured by the native library's probe (csrc/probe.cpp).

Decode is bound by memory, so each kernel is judged by the fraction of this rate it reaches:
the benchmarks print a kernel's achieved GB/s beside the probe's, with one thread and with all.
The buffer is far larger than the last-level cache and on huge pages, as the KV cache is.
"""

from __future__ import annotations

import torch

from quill.ops import library, memory


def read_bandwidth(threads: int | None = None, size: int = 512 << 20, repeats: int = 5) -> float:
    """Bytes per second one read of `size` bytes reaches, best of `repeats`, with one thread
    (threads=1) or all of torch's (None)."""
    if library.load() is None:
        raise RuntimeError("the bandwidth probe needs the native library (`make setup`)")
    buffer = memory.zeros((size // 4,), torch.float32, torch.device("cpu"))
    buffer.fill_(1.0)  # commit every page before timing
    threads = torch.get_num_threads() if threads is None else threads
    best_seconds = torch.ops.quill.read_probe(buffer, threads, repeats)[0].item()
    return size / best_seconds
