"""The peak rates the roofline needs, measured the way the engine would meet them.

A CPU's datasheet peak is not what `F.linear` reaches at a 576-wide layer and one token, and
DRAM bandwidth is not what a matrix-vector product streams. The roofline floor is only
meaningful against rates the engine's own kernels can reach, so these are timed on the
model's own layer shapes, at the token counts a step runs, with the best run of each kept.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from quill.cost.model import ModelSpec

_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
_TOKENS_QUICK = (1, 16, 128, 512, 2048)
_SAMPLED_MAX = 64  # the lm_head runs on sampled rows only: a step has few of them


def linear_shapes(model: ModelSpec) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of each distinct matrix a pass multiplies by."""
    h, i = model.hidden_size, model.intermediate_size
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return [
        ("qkv", h, q + 2 * kv),
        ("o", q, h),
        ("gate_up", h, 2 * i),
        ("down", i, h),
        ("lm_head", h, model.vocab_size),
    ]


def _sync(device: torch.device) -> Callable[[], None]:
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def best_time(fn: Callable[[], object], sync: Callable[[], None], budget_s: float = 0.03) -> float:
    """Fastest of a few calls after one warm-up: the rate the kernel can reach, not the noise
    of a machine shared with others."""
    fn()
    sync()
    best, spent, reps = math.inf, 0.0, 0
    while reps < 1 or (spent < budget_s and reps < 20):
        t = time.perf_counter()
        fn()
        sync()
        dt = time.perf_counter() - t
        best, spent, reps = min(best, dt), spent + dt, reps + 1
    return best


def measure_matmul(
    model: ModelSpec, device: torch.device, dtype: torch.dtype, token_counts: list[int]
) -> dict[str, dict[int, float]]:
    """FLOP/s of F.linear per layer shape and token count."""
    sync = _sync(device)
    out: dict[str, dict[int, float]] = {}
    with torch.inference_mode():
        for name, fan_in, fan_out in linear_shapes(model):
            weight = torch.randn(fan_out, fan_in, device=device).to(dtype) * fan_in**-0.5
            rates = {}
            for n in token_counts:
                if name == "lm_head" and n > _SAMPLED_MAX:
                    continue
                x = torch.randn(n, fan_in, device=device).to(dtype)
                seconds = best_time(lambda x=x, w=weight: F.linear(x, w), sync)
                rates[n] = 2 * n * fan_in * fan_out / seconds
            out[f"{name} {fan_in}x{fan_out}"] = rates
    return out


def cache_bytes() -> int:
    """The largest CPU cache, from sysfs (0 when unknown)."""
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip().upper()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            sizes.append(int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return max(sizes, default=0)


def measure_bandwidth(device: torch.device, dtype: torch.dtype, nbytes: int) -> float:
    """Bytes/s of weights streamed through a matrix-vector product, as a batch-1 decode does."""
    cols = 4096
    elem = torch.empty((), dtype=dtype).element_size()
    rows = max(1, nbytes // (cols * elem))
    with torch.inference_mode():
        weight = torch.full((rows, cols), 0.5, dtype=dtype, device=device)
        x = torch.full((1, cols), 0.25, dtype=dtype, device=device)
        seconds = best_time(lambda: F.linear(x, weight), _sync(device), budget_s=0.2)
    return rows * cols * elem / seconds


def memory_capacity(device: torch.device) -> float:
    """Bytes of memory: the GPU's, or MemTotal of /proc/meminfo."""
    if device.type == "cuda":
        return float(torch.cuda.get_device_properties(device).total_memory)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(int(line.split()[1]) * 1024)
    except OSError:
        pass
    import os

    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def device_name(device: torch.device, cpu_model: str) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{cpu_model} ({torch.get_num_threads()} threads)"


def measure_peaks(
    model: ModelSpec,
    device: torch.device,
    max_tokens: int,
    engine_dtype: torch.dtype = torch.float32,
    quick: bool = False,
    log: Callable[[str], None] = print,
) -> dict:
    """Matmul FLOP/s per dtype (best over the model's shapes) and streaming bandwidth."""
    dtypes = [torch.float32, torch.bfloat16] + ([torch.float16] if device.type == "cuda" else [])
    flops, matmul = {}, {}
    for dtype in dtypes:
        # Every token count for the engine's dtype; the others get the short list.
        many = dtype == engine_dtype and not quick
        counts = [n for n in (_TOKENS if many else _TOKENS_QUICK) if n <= max_tokens] or [1]
        name = str(dtype).removeprefix("torch.")
        table = measure_matmul(model, device, dtype, counts)
        matmul[name] = {
            shape: {str(n): r for n, r in rates.items()} for shape, rates in table.items()
        }
        flops[name] = max(r for rates in table.values() for r in rates.values())
        log(_matmul_table(name, table, counts))
    if device.type == "cuda":
        nbytes = 2 << 30
    else:
        nbytes = max(256 << 20, 8 * cache_bytes())
    bandwidth = {}
    for dtype in (torch.float32, torch.bfloat16):
        bandwidth[str(dtype).removeprefix("torch.")] = measure_bandwidth(device, dtype, nbytes)
    log(
        f"weight streaming ({nbytes >> 20} MiB matrix-vector): "
        + ", ".join(f"{d} {b / 1e9:.1f} GB/s" for d, b in bandwidth.items())
    )
    return {
        "flops": flops,
        "memory_bandwidth": max(bandwidth.values()),
        "details": {
            "matmul_flops_per_s": matmul,
            "bandwidth_bytes_per_s": bandwidth,
            "bandwidth_buffer_bytes": nbytes,
            "largest_cache_bytes": cache_bytes() if device.type == "cpu" else None,
        },
    }


def _matmul_table(dtype: str, table: dict[str, dict[int, float]], counts: list[int]) -> str:
    head = f"matmul GFLOP/s, {dtype}: " + "".join(f"{n:>7}" for n in counts)
    lines = [head]
    for shape, rates in table.items():
        cells = "".join(f"{rates[n] / 1e9:7.1f}" if n in rates else f"{'':7}" for n in counts)
        lines.append(f"  {shape:<{len(head) - 7 * len(counts) - 2}}{cells}")
    return "\n".join(lines)
