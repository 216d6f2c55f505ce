"""Cost-model accuracy: real engine steps on this machine against their calibrated prices.

The cost model is only worth its numbers if they match the steps the engine really runs. This
runs a sweep of real steps (decode batches of 1 to 64 at contexts of ~50, 500 and 1,500 tokens,
prompt chunks of 16 to 2,048 tokens, chunks after a cached prefix, several prompts per step,
decodes mixed with a chunk), prices each with the hardware file, and reports the absolute
relative error of the calibrated prediction and of the roofline floor (which is a floor, not a
prediction: its error says how far the engine runs from peak), overall and per step kind.

Without `--hardware`, it also calibrates, on other shapes (the same sweep as `quill cost
calibrate`) run interleaved with the evaluation in one shuffled order, so the evaluation steps
are never the ones fitted and the machine's drift between minutes hits both alike. Usage:

    .venv/bin/python benchmarks/bench_cost.py [--quick] [--hardware FILE] [--json out.json]
    .venv/bin/python benchmarks/bench_cost.py --rescore out.json --hardware NEW.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from quill.cost import fit
from quill.cost.calibrate import calibration_cases, cpu_info, describe, fit_spec, set_threads
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec, bytes_per_element
from quill.cost.step import CostModel
from quill.cost.sweep import Case, MeasuredStep, Sweep, engine_for

KINDS = ("decode", "prefill", "mixed")


def evaluation_cases(quick: bool, steps: int, warmup: int) -> list[Case]:
    batches = [1, 4, 16, 64] if quick else [1, 2, 4, 8, 16, 32, 64]
    contexts = [50, 500, 1500]
    chunks = [16, 128, 512, 2048] if quick else [16, 32, 64, 128, 256, 512, 1024, 2048]
    cases = [Case(b, c) for c in contexts for b in batches]
    cases += [Case(chunks=1, chunk=n) for n in chunks]
    cases += [Case(chunks=1, chunk=512, chunk_start=1536), Case(chunks=4, chunk=128)]
    cases += [Case(16, 500, chunks=1, chunk=512), Case(64, 50, chunks=1, chunk=64)]
    cases += [Case(4, 1500, chunks=1, chunk=256)]
    if not quick:
        cases += [Case(chunks=1, chunk=256, chunk_start=512), Case(chunks=2, chunk=1024)]
        cases += [Case(chunks=8, chunk=64), Case(chunks=1, chunk=1024, chunk_start=1024)]
        cases += [Case(1, 50, chunks=1, chunk=128), Case(8, 1500, chunks=1, chunk=64)]
        cases += [Case(32, 500, chunks=1, chunk=256), Case(64, 1500, chunks=1, chunk=512)]
    return [replace(c, steps=steps, warmup=warmup) for c in cases]


def summarize(kinds: list[str], measured: list[float], predicted: list[float]) -> dict:
    out = {"all": fit.error_summary(predicted, measured)}
    for kind in KINDS:
        idx = [i for i, k in enumerate(kinds) if k == kind]
        out[kind] = fit.error_summary([predicted[i] for i in idx], [measured[i] for i in idx])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", help="a `quill cost calibrate` file (default: calibrate first)")
    p.add_argument("--model", help="model directory or .gguf (default: the default model)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="auto")
    p.add_argument("--load-format", default="auto")
    p.add_argument("--tokenizer")
    p.add_argument("--quick", action="store_true", help="a smaller sweep (a few minutes)")
    p.add_argument("--steps", type=int, help="measured steps per shape (default 4; quick 2)")
    p.add_argument("--warmup", type=int, default=1, help="discarded steps per shape")
    p.add_argument("--threads", type=int, help="torch threads (default: every available core)")
    p.add_argument("--save-hardware", metavar="FILE", help="keep the calibration made here")
    p.add_argument("--json", metavar="FILE", help="write every step and the errors here")
    p.add_argument(
        "--rescore",
        metavar="JSON",
        help="run nothing: price the steps of an earlier --json again (with --hardware, or the "
        "hardware it used)",
    )
    args = p.parse_args(argv)
    started = time.perf_counter()
    if args.rescore:
        run = _rescored(args)
    else:
        run = _measure(args)
    steps, spec, model = run["steps"], run["spec"], run["model"]
    cost_model = CostModel(model, spec)
    shapes, costs = fit.price_steps(cost_model, [s.seqs for s in steps])
    measured = [s.duration for s in steps]
    predicted = [c.predicted_s for c in costs]
    floor = [c.roofline_s for c in costs]
    kinds = [s.kind for s in steps]
    calibrated = summarize(kinds, measured, predicted)
    roofline = summarize(kinds, measured, floor)
    _print_cases(steps, predicted, floor)
    _print_summary(calibrated, roofline)
    if not args.json:
        return 0
    cpu = cpu_info()
    report = {
        "median_error": calibrated["all"]["median"],
        "p90_error": calibrated["all"]["p90"],
        "roofline_median_error": roofline["all"]["median"],
        "roofline_p90_error": roofline["all"]["p90"],
        "by_kind": {k: calibrated[k] for k in KINDS},
        "roofline_by_kind": {k: roofline[k] for k in KINDS},
        "model": model.name,
        "model_path": run["model_path"],
        "dtype": model.dtype,
        "bytes_per_param": model.bytes_per_param,
        "device": run["device"],
        "threads": run["threads"],
        "hardware": spec.to_dict(),
        "hardware_file": args.hardware,
        "cpu_model": run.get("cpu_model", cpu["cpu_model"]),
        "cpu_flags": run.get("cpu_flags", cpu["cpu_flags"]),
        "command": " ".join([sys.executable, *sys.argv]),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "wall_s": time.perf_counter() - started,
        "steps": [
            {
                **s.to_dict(),
                "measured_s": s.duration,
                "predicted_s": c.predicted_s,
                "roofline_s": c.roofline_s,
                "num_seqs": shape.num_seqs,
                "num_tokens": shape.num_tokens,
                "num_decode_tokens": shape.num_decode_tokens,
                "kv_tokens_read": shape.kv_tokens_read,
                "attention_pairs": shape.attention_pairs,
            }
            for s, c, shape in zip(steps, costs, shapes)
        ],
        # What the calibration made by this run was fitted on (none with --hardware).
        "calibration_steps": [s.to_dict() for s in run["calibration_steps"]],
    }
    if args.rescore:
        report["rescored_from"] = args.rescore
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


def _measure(args: argparse.Namespace) -> dict:
    """Run the sweep on the real engine (calibrating first on other shapes without --hardware)."""
    threads = set_threads(args.threads)
    print(f"torch threads: {threads} (cores available: {len(os.sched_getaffinity(0))})")
    steps = args.steps or (2 if args.quick else 4)
    cases = evaluation_cases(args.quick, steps, args.warmup)
    calib_steps = max(1, steps // 2)  # calibrate's own default: 2 per shape, quick 1
    calib_cases = [] if args.hardware else calibration_cases(quick=args.quick, steps=calib_steps)
    engine = engine_for(
        cases + calib_cases, args.model, args.dtype, args.device, args.load_format, args.tokenizer
    )
    dtype = str(engine.dtype).removeprefix("torch.")
    model = ModelSpec.from_path(engine.model_path, engine.dtype.itemsize)
    model.dtype = dtype
    fitted_on = []
    if args.hardware:
        spec = HardwareSpec.resolve(args.hardware)
        _check_dtype(spec, dtype)
        measured = Sweep(engine, seed=2).run(cases, "evaluation steps")
    else:
        from quill.cost.microbench import measure_peaks

        peaks = measure_peaks(model, engine.device, 2048, engine.dtype, args.quick)
        # Both sweeps in one shuffled order: the machine drifts by 10-20% between minutes,
        # and a fit made in a fast minute would be judged in a slow one.
        tagged = [("calibration", c) for c in calib_cases] + [("evaluation", c) for c in cases]
        random.Random(3).shuffle(tagged)
        runs = Sweep(engine, seed=2).run_tagged(tagged, "calibration + evaluation steps")
        fitted_on, measured = runs["calibration"], runs["evaluation"]
        spec = fit_spec(engine, fitted_on, peaks)
        print("calibrated on its own shapes, interleaved with the evaluation:\n" + describe(spec))
        if args.save_hardware:
            spec.save(args.save_hardware)
    return {
        "steps": measured,
        "spec": spec,
        "model": model,
        "model_path": str(engine.model_path),
        "device": str(engine.device),
        "threads": threads,
        "calibration_steps": fitted_on,
    }


def _rescored(args: argparse.Namespace) -> dict:
    """The steps of an earlier run, to price again (a new calibration, a changed cost model)."""
    old = json.loads(Path(args.rescore).read_text())
    steps = [
        MeasuredStep(s["case"], s["kind"], s["duration"], [tuple(x) for x in s["seqs"]])
        for s in old["steps"]
    ]
    path = args.model or old.get("model_path")
    if path is None:
        from quill.model.default_model import default_model_dir

        path = default_model_dir()
    size = bytes_per_element(old["dtype"])
    model = ModelSpec.from_path(path, old.get("bytes_per_param", size))
    model.dtype = old["dtype"]
    if args.hardware:
        spec = HardwareSpec.resolve(args.hardware)
        _check_dtype(spec, model.dtype)
    else:
        spec = HardwareSpec.from_dict(old["hardware"])
    keep = ("device", "threads", "cpu_model", "cpu_flags", "model_path")
    return {
        **{k: old.get(k) for k in keep},
        "steps": steps,
        "spec": spec,
        "model": model,
        "calibration_steps": [],
    }


def _check_dtype(spec: HardwareSpec, dtype: str) -> None:
    fitted_for = (spec.calibration or {}).get("dtype")
    if fitted_for not in (None, dtype):
        print(f"warning: {spec.name} was calibrated for {fitted_for}, these steps are {dtype}")


def _print_cases(steps, predicted: list[float], floor: list[float]) -> None:
    by_case: dict[str, list[int]] = {}
    for i, s in enumerate(steps):
        by_case.setdefault(s.case, []).append(i)
    print(f"\n{'case':<34}{'kind':<9}{'measured':>10}{'predicted':>11}{'error':>8}{'floor':>9}")
    for case, idx in by_case.items():
        m = statistics.median(steps[i].duration for i in idx)
        p = statistics.median(predicted[i] for i in idx)
        f = statistics.median(floor[i] for i in idx)
        print(
            f"{case:<34}{steps[idx[0]].kind:<9}{m * 1e3:>8.1f}ms{p * 1e3:>9.1f}ms"
            f"{(p - m) / m:>+8.0%}{f * 1e3:>7.1f}ms"
        )


def _print_summary(calibrated: dict, roofline: dict) -> None:
    print("\nabsolute relative error per step, median / p90 (held-out steps)")
    print(f"{'':<10}{'steps':>6}{'calibrated':>20}{'roofline floor':>20}")
    for kind in ("all", *KINDS):
        c, r = calibrated[kind], roofline[kind]
        if not c["steps"]:
            continue
        print(
            f"{kind:<10}{c['steps']:>6}{c['median']:>11.1%} / {c['p90']:<6.1%}"
            f"{r['median']:>11.1%} / {r['p90']:<6.1%}"
        )


if __name__ == "__main__":
    sys.exit(main())
