"""What the engine benchmarks ran on: the machine's description and its measured rates.

machine_info() is the JSON "machine" block (CPU model and SIMD flags, threads, versions, date,
command line); weight_stream_rate() and gemm_flops() measure the two roofline limits a decode
step runs into, and matmul_params() counts the weights each token multiplies through.
"""

from __future__ import annotations

import math
import os
import platform
import shlex
import sys
import time
from datetime import UTC, datetime

import torch
import torch.nn.functional as F


def machine_info(threads: int) -> dict:
    model, flags = "", []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key == "flags" and not flags:
                    flags = sorted(
                        fl
                        for fl in value.split()
                        if fl in ("avx", "avx2", "fma") or fl.startswith(("avx512", "amx"))
                    )
    except OSError:
        pass
    return {
        "cpu": model or platform.processor() or platform.machine(),
        "cpu_flags": flags,
        "arch": platform.machine(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": shlex.join([sys.executable, *sys.argv]),
    }


def read_probe_rate() -> float | None:
    """The native library's read probe with all threads (None without the library)."""
    from quill.ops import library, probe

    return probe.read_bandwidth() if library.load() is not None else None


def _best_time(fn, repeats: int) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def weight_stream_rate(rows: int = 8192, cols: int = 8192, repeats: int = 10) -> float:
    """Bytes/s of F.linear pushing one row through a large fp32 weight (far beyond the caches)."""
    w = torch.randn(rows, cols)
    x = torch.randn(1, cols)
    with torch.inference_mode():
        t = _best_time(lambda: F.linear(x, w), repeats)
    return w.numel() * w.element_size() / t


def gemm_flops(m: int = 512, n: int = 2048, k: int = 2048, repeats: int = 5) -> float:
    """FLOP/s of an fp32 GEMM big enough to be compute-bound."""
    a, w = torch.randn(m, k), torch.randn(n, k)
    with torch.inference_mode():
        t = _best_time(lambda: F.linear(a, w), repeats)
    return 2 * m * n * k / t


def matmul_params(cfg) -> int:
    """Weights every token multiplies through: the blocks' projections and the LM head."""
    q = cfg.num_heads * cfg.head_dim
    kv = cfg.num_kv_heads * cfg.head_dim
    attn = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size
    mlp = 3 * cfg.hidden_size * cfg.intermediate_size
    return cfg.num_layers * (attn + mlp) + cfg.vocab_size * cfg.hidden_size


def kernel_rates(cfg, repeats: int = 5) -> dict[str, dict[str, float]]:
    """Each product kernel on the output head's shape (vocab x hidden, far beyond L2): weight
    GB/s for one row (a batch-1 step's regime) and GFLOP/s for 256 rows (a prompt's), beside the
    probe's bandwidth and the fp32 GEMM's rate in the plot. Native kernels only where built."""
    from quill.ops import library, qlinear

    n, k = cfg.vocab_size, cfg.hidden_size
    w = torch.randn(n, k) * 0.05

    def size(packed) -> int:
        tensors = [t for t in vars(packed).values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in tensors)

    kernels = {
        "F.linear fp32": (lambda x, w=w: F.linear(x, w), 4 * n * k),
        "F.linear bf16": (lambda x, w=w.bfloat16(): F.linear(x, w), 2 * n * k),
    }
    if library.load() is not None:
        wb = w.bfloat16()
        q8 = qlinear.pack(*qlinear.quantize_q8_0(w))
        q4 = qlinear.pack_q4(*qlinear.quantize_q4_1(w))
        kernels["quill dense bf16"] = (lambda x: torch.ops.quill.dense_linear(x, wb), 2 * n * k)
        kernels["quill Q8_0"] = (lambda x: qlinear.native_q8_linear(x, q8), size(q8))
        kernels["quill Q4_1"] = (lambda x: qlinear.native_q4_linear(x, q4), size(q4))
    rates = {}
    with torch.inference_mode():
        for name, (fn, nbytes) in kernels.items():
            dtype = torch.float32 if "fp32" in name else torch.bfloat16
            one, many = torch.randn(1, k, dtype=dtype), torch.randn(256, k, dtype=dtype)
            t_one = _best_time(lambda fn=fn, x=one: fn(x), repeats)
            t_many = _best_time(lambda fn=fn, x=many: fn(x), repeats)
            rates[name] = {
                "GBps_1_row": nbytes / t_one / 1e9,
                "GFLOPs_256_rows": 2 * 256 * n * k / t_many / 1e9,
            }
    return rates
