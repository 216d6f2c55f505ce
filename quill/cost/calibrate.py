"""`quill cost calibrate`: measure this machine and save it as a hardware file.

Datasheet peaks say what a chip could do; a CPU engine in plain PyTorch runs far below them,
and where its time goes (a fixed cost per step, the KV gather) no roofline shows. So this
measures both: the peaks the cost model's roofline needs (matrix-multiply FLOP/s at the engine's
own shapes, weight-streaming bandwidth, memory), and a sweep of real engine steps whose times
fit the additive model's coefficients (quill.cost.fit). Later commands read the file with
`--hardware FILE`, and the engine finds it by itself in `$QUILL_CACHE/hardware`.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import socket
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from quill.cost import fit
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.refit import (
    calibrated_model,
    recorded_steps,
    refit_spec,
    step_gaps,
    step_time_ratios,
)
from quill.cost.step import CostModel
from quill.cost.sweep import Case, MeasuredStep, Sweep, engine_for


def calibration_cases(
    max_batch: int = 64,
    max_context: int = 1536,
    max_chunk: int = 2048,
    steps: int = 2,
    warmup: int = 1,
    quick: bool = False,
) -> list[Case]:
    """The fitting sweep: decodes over batch and context, prompt chunks, mixed steps."""
    if min(max_batch, max_context, max_chunk, steps) < 1 or warmup < 0:
        raise ValueError(
            "--max-batch, --max-context, --max-chunk and --steps must be at least 1, "
            "--warmup at least 0"
        )

    def upto(values, limit):
        return sorted({min(v, limit) for v in values})

    # Batch x context spreads the KV per layer over 0.05-150 MB for the default model in fp32,
    # so a knee near the last-level cache has steps on both sides of it.
    batches = upto([1, 16, 64] if quick else [1, 4, 16, 32, 64], max_batch)
    contexts = upto([32, 384, 1536] if quick else [32, 256, 768, 1536], max_context)
    chunks = upto([16, 128, 512] if quick else [16, 64, 256, 512, 1024, 2048], max_chunk)
    mid_batch, mid_context = batches[len(batches) // 2], contexts[len(contexts) // 2]
    small_chunk, mid_chunk = chunks[0], chunks[len(chunks) // 2]
    cases = [Case(b, c) for c in contexts for b in batches]
    cases += [Case(chunks=1, chunk=n) for n in chunks]
    cases += [
        Case(chunks=4, chunk=small_chunk),  # several prompts in one step
        Case(chunks=1, chunk=mid_chunk, chunk_start=max_context),  # a later chunk of a prompt
        Case(mid_batch, mid_context, chunks=1, chunk=mid_chunk),
        Case(batches[-1], contexts[-1], chunks=1, chunk=small_chunk),
        Case(batches[0], contexts[0], chunks=1, chunk=chunks[-1]),
    ]
    unique = list(dict.fromkeys(cases))
    return [replace(c, steps=steps, warmup=warmup) for c in unique]


def set_threads(threads: int | None) -> int:
    """Every core this process may run on (or `threads`), for torch's intra-op pool."""
    import torch

    available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    torch.set_num_threads(threads or available or 1)
    return torch.get_num_threads()


def cpu_info() -> dict:
    """The CPU's model name and feature flags, from /proc/cpuinfo (empty where there is none)."""
    info = {"cpu_model": platform.processor() or platform.machine(), "cpu_flags": []}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and info["cpu_model"] in ("", platform.machine()):
            info["cpu_model"] = value.strip()
        elif key == "flags":
            info["cpu_flags"] = value.split()
            break
    return info


def default_out(dtype: str, key: dict | None = None) -> Path:
    """Where this machine's calibration for `dtype` goes: one file per key (freshness.py), so
    that calibrations for other weight formats or builds live side by side."""
    from quill.config import cache_dir
    from quill.cost.freshness import key_name

    host = socket.gethostname() or cpu_info()["cpu_model"]
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", host).strip("-") or "this-machine"
    suffix = f"-{key_name(key)}" if key else ""
    return cache_dir() / "hardware" / f"{slug}-{dtype}{suffix}.json"


def fit_spec(
    engine,
    steps: list[MeasuredStep],
    peaks: dict,
    name: str | None = None,
) -> HardwareSpec:
    """A HardwareSpec from measured peaks and the steps' fitted coefficients."""
    from quill.cost import microbench

    dtype = str(engine.dtype).removeprefix("torch.")
    model = ModelSpec.from_path(engine.model_path, engine.dtype.itemsize)
    model.dtype = dtype
    model.kv_bytes_per_element = engine.kv_format.bytes_per_element
    cpu = cpu_info()
    device = engine.device
    base = HardwareSpec(
        name=name or microbench.device_name(device, cpu["cpu_model"]),
        flops=peaks["flops"],
        memory_bandwidth=peaks["memory_bandwidth"],
        memory_capacity=microbench.memory_capacity(device),
        matmul_rates=matmul_rates(peaks["details"]["matmul_flops_per_s"].get(dtype), model),
    )
    roofline = CostModel(model, base)
    shapes, costs = fit.price_steps(roofline, [s.seqs for s in steps])
    durations = [s.duration for s in steps]
    coefficients = fit.fit_calibration(
        costs, shapes, durations, model.weight_bytes, 1 / base.memory_bandwidth, model.num_layers
    )
    layers = model.num_layers or 0
    predicted = [fit.predict(coefficients, c, s, layers) for c, s in zip(costs, shapes)]
    # The uncalibrated predictor is roofline + step_overhead_s: take the overhead from the
    # smallest decode steps, where nothing but the weights and the fixed cost remains.
    small = [i for i, s in enumerate(steps) if s.kind == "decode" and len(s.seqs) == 1]
    small = small or list(range(len(steps)))
    least = min(shapes[i].kv_tokens_read for i in small)
    gaps = sorted(
        durations[i] - costs[i].roofline_s for i in small if shapes[i].kv_tokens_read == least
    )
    step_overhead = max(0.0, gaps[len(gaps) // 2])
    from quill.cost.freshness import current_key, weight_formats

    calibration = {
        **coefficients,
        "key": current_key(weight_formats(engine.runner.model)),
        "quantization": engine.config.quantization,
        "model": model.name,
        "model_path": str(engine.model_path),
        "dtype": dtype,
        "kv_cache_dtype": engine.kv_format.name,
        "device": str(device),
        "threads": _threads(),
        "fitted_steps": len(steps),
        "fitted_cases": len({s.case for s in steps}),
        "fit_error": fit.error_summary_by_kind(steps, predicted),
        "step_time_ratios": step_time_ratios(steps, predicted),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "host": socket.gethostname(),
        "cpu_model": cpu["cpu_model"],
        "cpu_flags": cpu["cpu_flags"],
        "torch": _torch_version(),
        "python": platform.python_version(),
        "microbenchmarks": peaks["details"],
    }
    return HardwareSpec(
        name=base.name,
        flops=base.flops,
        memory_bandwidth=base.memory_bandwidth,
        memory_capacity=base.memory_capacity,
        step_overhead_s=step_overhead,
        calibration=calibration,
        matmul_rates=base.matmul_rates,
        notes=(
            f"measured by `quill cost calibrate` on {len(steps)} engine steps of {model.name} "
            f"({dtype}, {_threads()} threads); flops and memory_bandwidth are microbenchmark "
            "peaks, calibration holds the fitted additive step-time model"
        ),
    )


def matmul_rates(measured: dict | None, model: ModelSpec) -> dict | None:
    """The layers' achieved FLOP/s per row count (their products' FLOPs over their summed
    times, so each shape weighs by its size) and the lm_head's, from the microbenchmark."""
    if not measured:
        return None
    from quill.cost.microbench import linear_shapes

    sizes = {f"{name} {k}x{n}": k * n for name, k, n in linear_shapes(model)}
    lm_head = next(key for key in sizes if key.startswith("lm_head"))
    layer_keys = [key for key in sizes if key != lm_head and key in measured]
    rows = sorted({int(t) for key in layer_keys for t in measured[key]})
    layers = []
    for t in rows:
        if all(str(t) in measured[key] for key in layer_keys):
            flops = sum(sizes[key] for key in layer_keys)
            seconds = sum(sizes[key] / measured[key][str(t)] for key in layer_keys)
            layers.append([t, flops / seconds])
    out = {"layers": layers}
    if lm_head in measured:
        out["lm_head"] = [[int(t), r] for t, r in measured[lm_head].items()]
    return out if layers else None


def _tp_sizes(text: str | None) -> list[int]:
    if text is None:
        return [2, 3] + ([4] if len(os.sched_getaffinity(0)) >= 4 else [])
    if text.strip().lower() == "none":
        return []
    sizes = [int(part) for part in text.split(",") if part.strip()]
    if any(n < 2 for n in sizes):
        raise ValueError(f"--tp-sizes are rank counts of 2 or more, got {text!r}")
    return sizes


def _default(value: int | None, default: int) -> int:
    return default if value is None else value


def _threads() -> int:
    import torch

    return torch.get_num_threads()


def _torch_version() -> str:
    import torch

    return torch.__version__


def describe(spec: HardwareSpec) -> str:
    """The fitted coefficients as rates a person recognises."""
    c = spec.coefficients or {}

    def rate(key: str, unit: float, label: str) -> str:
        value = c.get(key, 0.0)
        return f"{1 / value / unit:8.2f} {label}" if value > 0 else "       - (not needed)"

    err = spec.calibration.get("fit_error", {}) if spec.calibration else {}
    lines = [
        f"  overhead per step       {c.get('overhead_s', 0) * 1e3:8.2f} ms",
        f"  per sequence            {c.get('per_seq_s', 0) * 1e3:8.3f} ms",
        f"  weight streaming        {rate('s_per_weight_byte', 1e9, 'GB/s')}",
        f"  linear layers           {rate('s_per_linear_flop', 1e9, 'GFLOP/s')}",
        f"  attention               {rate('s_per_attention_flop', 1e9, 'GFLOP/s')}",
        f"  KV cache traffic        {rate('s_per_kv_byte', 1e9, 'GB/s')}",
    ]
    if c.get("s_per_kv_byte_over_knee"):
        knee = c["kv_knee_bytes_per_layer"] / 1e6
        total = 1 / (c["s_per_kv_byte"] + c["s_per_kv_byte_over_knee"]) / 1e9
        lines.append(f"  {f'KV past {knee:.3g} MB/layer':<24}{total:8.2f} GB/s")
    for kind, e in err.items():
        if e.get("steps"):
            lines.append(
                f"  fit error {kind:8s}      median {e['median']:6.1%}  p90 {e['p90']:6.1%}"
                f"  ({e['steps']} steps, in-sample)"
            )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="quill cost calibrate",
        description="Measure this machine (matmul FLOP/s, weight-streaming bandwidth, a sweep of "
        "real engine steps) and save a hardware file for `--hardware`.",
    )
    p.add_argument("--model", help="model directory or .gguf (default: the default model)")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    p.add_argument("--tokenizer", help="tokenizer source (needed with --load-format dummy)")
    p.add_argument(
        "--out",
        help="hardware file to write (default: $QUILL_CACHE/hardware/...; "
        "with --check: its report, JSON)",
    )
    p.add_argument("--name", help="the hardware's name in the file (default: CPU or GPU name)")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (about a minute)")
    p.add_argument("--max-batch", type=int, help="largest decode batch (default 64)")
    p.add_argument("--max-context", type=int, help="longest context (default 1536)")
    p.add_argument("--max-chunk", type=int, help="largest prompt chunk (default 2048; quick 512)")
    p.add_argument("--steps", type=int, help="measured steps per shape (default 2; quick 1)")
    p.add_argument("--warmup", type=int, default=1, help="discarded steps per shape (default 1)")
    p.add_argument("--threads", type=int, help="torch threads (default: every available core)")
    p.add_argument("--save-steps", metavar="FILE", help="also write the measured steps (JSONL)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument(
        "--from-steps",
        metavar="FILE",
        help="fit on steps a running engine recorded (`quill serve --record-steps FILE`) "
        "instead of a sweep, keeping the rates of --base: what a step costs while serving",
    )
    p.add_argument("--base", metavar="FILE", help="the hardware file --from-steps starts from")
    p.add_argument(
        "--quantization",
        default="none",
        help="the weights' quantization while measuring (none, the default; int8, int4, auto: "
        "what the server to be priced runs)",
    )
    p.add_argument(
        "--check",
        nargs="?",
        const="",
        metavar="FILE",
        help="measure a calibration's error on held-out steps (shapes it was not fitted on) and "
        "whether it is stale for this process; FILE, or this machine's newest",
    )
    p.add_argument(
        "--tp-sizes",
        default=None,
        metavar="N,N",
        help="tensor-parallel sizes whose all-reduce to measure among ranks on this host "
        "(default 2 and 3, and 4 with 4 cores or more; 'none' for none)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except (ValueError, OSError) as e:
        print(f"quill cost calibrate: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def _main(args: argparse.Namespace) -> int:
    import json

    from quill.cost import microbench

    if args.from_steps:
        return _refit(args)
    if args.check is not None:
        from quill.cost.check import check

        return check(args)

    threads = set_threads(args.threads)
    print(
        f"torch threads: {threads} (cores available to this process: "
        f"{len(os.sched_getaffinity(0))})"
    )
    cases = calibration_cases(
        _default(args.max_batch, 64),
        _default(args.max_context, 1536),
        _default(args.max_chunk, 512 if args.quick else 2048),
        _default(args.steps, 1 if args.quick else 2),
        args.warmup,
        args.quick,
    )
    started = time.perf_counter()
    engine = engine_for(
        cases, args.model, args.dtype, args.device, args.load_format, args.tokenizer,
        quantization=args.quantization,
    )  # fmt: skip
    dtype = str(engine.dtype).removeprefix("torch.")
    model = ModelSpec.from_path(engine.model_path, engine.dtype.itemsize)
    model.kv_bytes_per_element = engine.kv_format.bytes_per_element
    print(
        f"model: {model.name} ({dtype}, {engine.device}), loaded in "
        f"{time.perf_counter() - started:.1f} s"
    )
    peaks = microbench.measure_peaks(
        model, engine.device, max(c.step_tokens for c in cases), engine.dtype, args.quick, print
    )
    steps = Sweep(engine).run(cases, "engine steps", progress=not args.no_progress)
    spec = fit_spec(engine, steps, peaks, args.name)
    sizes = _tp_sizes(args.tp_sizes)
    if sizes:
        from quill.distributed.allreduce import measure_allreduce

        print(f"all-reduce among {', '.join(map(str, sizes))} ranks on this host (gloo) ...")
        table = measure_allreduce(sizes, model.hidden_size, engine.dtype)
        spec = replace(spec, host_allreduce=table)
        for size, entry in table.items():
            print(
                f"  {size} ranks: {entry['latency_s'] * 1e6:.0f} us + bytes at "
                f"{entry['bandwidth'] / 1e9:.2f} GB/s"
            )
    out = Path(args.out) if args.out else default_out(dtype, spec.calibration["key"])
    out.parent.mkdir(parents=True, exist_ok=True)
    spec.save(out)
    if args.save_steps:
        with Path(args.save_steps).open("w") as f:
            for s in steps:
                f.write(json.dumps(s.to_dict()) + "\n")
    print(f"step overhead (batch-1 decode minus its roofline): {spec.step_overhead_s * 1e3:.2f} ms")
    print("fitted coefficients:")
    print(describe(spec))
    print(f"took {time.perf_counter() - started:.0f} s; wrote {out}")
    return 0


def _refit(args: argparse.Namespace) -> int:
    if not args.base or not args.out:
        raise ValueError("--from-steps needs --base FILE (the rates to keep) and --out FILE")
    base = HardwareSpec.load(args.base)
    model = calibrated_model(base, args.model)
    steps = recorded_steps(args.from_steps)
    spec = refit_spec(base, model, steps)
    from quill.engine.record import read_steps

    gaps = step_gaps(read_steps(args.from_steps))
    if gaps is not None:
        spec.calibration["step_gap"] = gaps
        print(f"between steps: {gaps['base_s'] * 1e3:.2f} ms + {gaps['per_seq_s'] * 1e6:.0f} us "
              f"per sequence ({gaps['steps']} back-to-back steps)")  # fmt: skip
    memory = spec.calibration.get("step_time_memory")
    if memory is not None:
        print(f"slow steps come in patches: {memory['shared']:.0%} of a step's stray is a level "
              f"lasting ~{memory['seconds']:.2g} s ({memory['steps']} timed steps)")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    spec.save(args.out)
    print(f"fitted on {len(steps)} recorded steps of {args.from_steps}:")
    print(describe(spec))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
