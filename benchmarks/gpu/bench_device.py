"""A real-shaped model's decode and prefill steps on one device, against that device's floors.

The model is `benchmarks/real_shapes.py`'s (Llama-3.1-8B by default) with random weights in
bf16, quill's engine with its defaults for the device but unquantized, prefix caching off. The
device's two ceilings are measured here first, in the same process:
- read bandwidth: a large device-to-device copy, bytes read and written over its time;
- matrix rate: a large bf16 matrix product's FLOP/s.
Then:
- decode at each batch: `batch` requests with `--context`-token prompts decode together; the
  median step time against the weight-read floor (every weight's bytes over the bandwidth),
  the KV-read floor added (each sequence's context), and the arithmetic floor (2 FLOPs per
  weight per token over the matrix rate);
- prefill: one `--prompt`-token prompt, its time to first token against the arithmetic floor
  (2 FLOPs per weight per token, the head's for the one row that samples, and attention's 4
  per head dimension per causal pair).
Writes a JSON with the machine, the model and every figure. Usage:

    python benchmarks/gpu/bench_device.py --device cuda --json out.json
    .venv/bin/python benchmarks/gpu/bench_device.py --device cpu --shape llama-3.2-1b \
        --layers 2 --batches 1,4 --context 64 --prompt 256 --steps 4   # the CPU dry run's size
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from real_shapes import write_shape  # noqa: E402

from quill import LLM, SamplingParams  # noqa: E402


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device, repeats: int) -> float:
    """The median seconds of `fn` over `repeats` runs after two warm-ups."""
    times = []
    for i in range(repeats + 2):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def copy_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes per second a device-to-device copy moves, read and written counted."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, 10)
    return 2 * num_bytes / seconds


def matmul_rate(device: torch.device, n: int) -> float:
    """FLOP/s of an n x n x n bf16 matrix product."""
    gen = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16, generator=gen)
    seconds = timed(lambda: a @ b, device, 10)
    return 2 * n**3 / seconds


def model_figures(llm: LLM) -> dict:
    """Weights' bytes (all, and read by a decode step), the weights multiplied per token, and
    the KV bytes per token."""
    engine = llm.engine
    params = dict(engine.runner.model.named_parameters())
    total = sum(p.numel() * p.element_size() for p in params.values())
    table = next(p for name, p in params.items() if "embed_tokens" in name)
    tied = not any("lm_head" in name for name in params)
    # The embedding table is a lookup (a few rows read), unless the head multiplies it too.
    table_bytes = 0 if tied else table.numel() * table.element_size()
    multiplied = sum(p.numel() for name, p in params.items() if "embed_tokens" not in name)
    cfg = engine.model_config
    return {
        "weight_bytes": total,
        "weight_bytes_read": total - table_bytes,
        "multiplied_params": multiplied + (table.numel() if tied else 0),
        "head_params": table.numel(),  # the output head's (only rows that sample reach it)
        "kv_bytes_per_token": cfg.kv_bytes_per_token * engine.kv_format.bytes_per_element,
        "layers": cfg.num_layers,
        "heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
    }


def decode(
    llm: LLM, batch: int, context: int, steps: int, seed: int, settle: int = 1
) -> list[float]:
    """Decode step times (s) of `batch` sequences of `context` prompt tokens decoding together."""
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(max_tokens=steps + settle + 1, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(batch):
        engine.add_request(torch.randint(100, vocab - 300, (context,), generator=gen).tolist(),
                           params)  # fmt: skip
    durations = []
    while engine.has_unfinished_requests():
        _, stats = engine.step_with_stats()
        if stats is not None and stats.num_prefill_tokens == 0 and stats.num_decode_tokens == batch:
            durations.append(stats.duration)
    # The first all-decode steps follow the prefill (and, compiled, compile and capture their
    # graphs): not steady yet.
    return durations[settle:]


def profile_decode(llm: LLM, batch: int, context: int, steps: int, device: torch.device) -> dict:
    """Where a decode step's time goes: kernels (or CPU ops) launched per step, and the time
    the device was busy in them against the step's wall time."""
    from torch.profiler import ProfilerActivity, profile

    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(max_tokens=steps + 2, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    for _ in range(batch):
        engine.add_request(torch.randint(100, vocab - 300, (context,), generator=gen).tolist(),
                           params)  # fmt: skip
    while True:  # to the first step where every sequence decodes
        _, stats = engine.step_with_stats()
        if stats is not None and stats.num_prefill_tokens == 0:
            break
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with profile(activities=activities) as prof:
        for _ in range(steps):
            _, stats = engine.step_with_stats()
            walls.append(stats.duration)
    while engine.has_unfinished_requests():
        engine.step()
    events = prof.events()
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type.name == "CUDA"]
        busy = sum(e.device_time for e in kernels) / 1e6  # us -> s
    else:
        kernels = [e for e in events if e.device_type.name == "CPU" and e.name.startswith("aten::")]
        busy = None
    wall = sum(walls)
    return {
        "batch": batch,
        "steps": steps,
        "wall_s_per_step": wall / steps,
        "kernels_per_step": len(kernels) / steps,
        "device_busy_s_per_step": None if busy is None else busy / steps,
        "device_busy_share": None if busy is None else busy / wall,
        "top_kernels": [
            {"name": e.key[:80], "count_per_step": e.count / steps,
             "device_s_per_step": e.device_time_total / 1e6 / steps}
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:12]
        ] if device.type == "cuda" else [],
    }  # fmt: skip


def prefill(llm: LLM, prompt: int, seed: int) -> float:
    """Seconds from adding one `prompt`-token request to its first token."""
    engine = llm.engine
    vocab = llm.tokenizer.vocab_size
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(100, vocab - 300, (prompt,), generator=gen).tolist()
    start = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape's")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens per sequence")
    parser.add_argument("--steps", type=int, default=24, help="decode steps timed per batch")
    parser.add_argument("--prompt", type=int, default=2000, help="the prefill's prompt tokens")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--copy-bytes", type=int, default=None)
    parser.add_argument("--matmul-n", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    batches = [int(b) for b in args.batches.split(",")]
    gpu = device.type == "cuda"
    result: dict = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": sys.version.split()[0],
        "args": {k: str(v) for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    bandwidth = copy_bandwidth(device, args.copy_bytes or ((4 << 30) if gpu else (256 << 20)))
    rate = matmul_rate(device, args.matmul_n or (8192 if gpu else 1024))
    result["copy_bandwidth_Bps"] = bandwidth
    result["matmul_bf16_flops"] = rate
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, bf16 matmul {rate / 1e12:.1f} TFLOP/s",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        path = write_shape(args.shape, Path(tmp), args.layers)
        started = time.perf_counter()
        llm = LLM(
            str(path),
            load_format="dummy",
            device=args.device,
            dtype="bfloat16",
            quantization="none",
            max_model_len=max(args.prompt, args.context + args.steps) + 8,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(args.prompt, max(batches)),
            kv_cache_memory=(8 << 30) if gpu else (512 << 20),
            enable_prefix_caching=False,
            compile=args.compile,
        )
        result["load_s"] = time.perf_counter() - started
        figures = model_figures(llm)
        result["model"] = {"shape": args.shape, **figures}
        weight_floor = figures["weight_bytes_read"] / bandwidth
        result["decode"] = {}
        for batch in batches:
            settle = 3 if args.compile else 1
            times = decode(llm, batch, args.context, args.steps, seed=batch, settle=settle)
            step = statistics.median(times)
            kv_floor = batch * (args.context + args.steps // 2) * figures["kv_bytes_per_token"]
            kv_floor /= bandwidth
            arith_floor = 2 * figures["multiplied_params"] * batch / rate
            result["decode"][str(batch)] = {
                "step_s_median": step,
                "step_s_min": min(times),
                "step_s_max": max(times),
                "steps": len(times),
                "tokens_per_s": batch / step,
                "weight_read_floor_s": weight_floor,
                "weight_and_kv_read_floor_s": weight_floor + kv_floor,
                "arithmetic_floor_s": arith_floor,
                "x_weight_read_floor": step / weight_floor,
                "x_weight_and_kv_read_floor": step / (weight_floor + kv_floor),
                "x_arithmetic_floor": step / arith_floor,
            }
            print(f"decode batch {batch}: {step * 1e3:.2f} ms a step = "
                  f"{step / weight_floor:.2f}x the weight-read floor "
                  f"({weight_floor * 1e3:.2f} ms), {step / (weight_floor + kv_floor):.2f}x "
                  f"with the KV, {step / arith_floor:.1f}x the arithmetic floor",
                  flush=True)  # fmt: skip
            save(args.json, result)  # so far: a run cut short still reports
        if args.compile:
            from torch._dynamo.utils import counters

            result["compile_counters"] = {k: dict(v) for k, v in counters.items() if v}
        result["decode_profile"] = profile_decode(llm, batches[0], args.context, 4, device)
        p = result["decode_profile"]
        print(f"profile, batch {p['batch']}: {p['kernels_per_step']:.0f} kernels a step, "
              f"device busy {p['device_busy_share'] or 0:.0%} of {p['wall_s_per_step'] * 1e3:.2f} "
              "ms", flush=True)  # fmt: skip
        prefill(llm, min(args.prompt, 64), seed=1)  # warm the prefill shapes
        seconds = min(prefill(llm, args.prompt, seed=s) for s in (2, 3))
        n, layers = args.prompt, figures["layers"]
        attention = 4 * layers * figures["heads"] * figures["head_dim"] * n * (n + 1) / 2
        body = figures["multiplied_params"] - figures["head_params"]
        flops = 2 * body * n + 2 * figures["head_params"] + attention  # one row samples
        result["prefill"] = {
            "prompt_tokens": n,
            "ttft_s": seconds,
            "flops": flops,
            "arithmetic_floor_s": flops / rate,
            "x_arithmetic_floor": seconds / (flops / rate),
            "tokens_per_s": n / seconds,
        }
        print(f"prefill of {n} tokens: {seconds * 1e3:.1f} ms = "
              f"{seconds / (flops / rate):.2f}x the arithmetic floor", flush=True)  # fmt: skip
        llm.close()
    save(args.json, result)
    return 0


def save(path: Path | None, result: dict) -> None:
    if path is not None:
        path.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    raise SystemExit(main())
