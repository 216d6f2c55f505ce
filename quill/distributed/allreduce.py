"""What an all-reduce costs among N ranks on this host: measured, then a line fit.

`quill cost calibrate` runs this for the tensor-parallel sizes at hand: N spawned processes
(one compute thread each, as the engine's ranks on a host this size would have), a gloo group,
all-reduces of one layer's output for 1 to 512 tokens in the model's dtype. The fit, seconds =
latency + bytes / bandwidth, is what the cost model charges each of a pass's 2 x num_layers
all-reduces (quill/cost/step.py); the points are kept beside it.
"""

from __future__ import annotations

import os
import time

import torch

TOKENS = (1, 4, 16, 64, 256, 512)


def measure_allreduce(
    sizes: list[int], hidden_size: int, dtype: torch.dtype, repeats: int = 50
) -> dict[str, dict]:
    """Per size: {"latency_s", "bandwidth", "points": [[bytes, seconds], ...]}."""
    from quill.distributed.group import free_port

    context = torch.multiprocessing.get_context("spawn")
    results = {}
    threads = max(1, len(os.sched_getaffinity(0)))
    for size in sizes:
        queue = context.Queue()
        address = f"127.0.0.1:{free_port()}"
        args = (size, address, hidden_size, str(dtype).removeprefix("torch."), repeats, queue)
        procs = [
            context.Process(target=_rank, args=(rank, *args), daemon=True) for rank in range(size)
        ]
        for proc in procs:
            proc.start()
        try:
            points = queue.get(timeout=120)
        finally:
            for proc in procs:
                proc.join(30)
                if proc.is_alive():
                    proc.kill()
        latency, bandwidth = fit_line(points)
        results[str(size)] = {
            "latency_s": latency,
            "bandwidth": bandwidth,
            "threads_per_rank": max(1, threads // size),
            "points": points,
        }
    return results


def fit_line(points: list[list[float]]) -> tuple[float, float]:
    """Least squares seconds = a + bytes / b; (a, b), a >= 0, with b capped when the time does
    not grow with the payload."""
    n = len(points)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    slope = max(slope, 1e-15)  # at most 1 PB/s: a flat line is all latency
    return max(my - slope * mx, 0.0), 1.0 / slope


def _rank(rank, size, address, hidden_size, dtype_name, repeats, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // size))
    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=size)
    dtype = getattr(torch, dtype_name)
    points = []
    for tokens in TOKENS:
        x = torch.randn(tokens, hidden_size).to(dtype)
        for _ in range(5):
            dist.all_reduce(x)
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(x)
            times.append(time.perf_counter() - start)
        seconds = torch.tensor([sorted(times)[len(times) // 2]])
        dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the slowest rank's median
        points.append([x.numel() * x.element_size(), float(seconds)])
    if rank == 0:
        queue.put(points)
    dist.destroy_process_group()
