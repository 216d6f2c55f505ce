"""`quill cost calibrate --check [FILE]`: a calibration's error on steps it was not fitted on,
and whether it is stale for this process (quill/cost/freshness.py).

The held-out steps are shapes between the fitting sweep's (other batch sizes, contexts and
chunk lengths, and mixes of them), measured on the calibration's own model, dtype and
quantization; each is priced with the file's coefficients and set against its measured time.
The exit status says whether the calibration is fresh (0) or stale (1).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from quill.cost.batch import BatchShape
from quill.cost.calibrate import calibration_cases
from quill.cost.fit import error_summary_by_kind
from quill.cost.freshness import current_key, stale_reasons, weight_formats
from quill.cost.hardware import HardwareSpec
from quill.cost.refit import calibrated_model
from quill.cost.step import CostModel
from quill.cost.sweep import Case, Sweep, engine_for


def held_out_cases(max_batch: int, max_context: int, max_chunk: int, steps: int) -> list[Case]:
    """Shapes the fitting sweep (of the same limits, full or quick) does not have."""
    fitted = {
        c for quick in (False, True) for c in calibration_cases(max_batch, max_context, max_chunk,
                                                                1, 0, quick)
    }  # fmt: skip

    def within(values, limit):
        return sorted({v for v in values if v <= limit})

    batches = within([2, 8, 24, 48], max_batch) or [max_batch]
    contexts = within([96, 512, 1024], max_context) or [max_context]
    chunks = within([48, 384, 1536], max_chunk) or [max_chunk]
    cases = [Case(b, c) for b in batches for c in contexts]
    cases += [Case(chunks=1, chunk=n) for n in chunks]
    cases += [Case(chunks=2, chunk=chunks[0])]
    cases += [Case(b, c, chunks=1, chunk=chunks[0]) for b, c in zip(batches, contexts)]
    cases += [Case(chunks=1, chunk=chunks[0], chunk_start=contexts[-1])]
    kept = [c for c in dict.fromkeys(cases) if replace(c, steps=1, warmup=0) not in fitted]
    return [replace(c, steps=steps, warmup=1) for c in kept]


def newest_calibration(directory: Path | None = None) -> Path:
    from quill.config import cache_dir

    directory = directory or cache_dir() / "hardware"
    found = []
    for path in directory.glob("*.json"):
        try:
            if (json.loads(path.read_text()).get("calibration") or {}).get("model_path"):
                found.append((path.stat().st_mtime, path))
        except (OSError, ValueError):
            continue
    if not found:
        raise ValueError(f"no calibration in {directory}: run `quill cost calibrate` first")
    return max(found)[1]


def check(args) -> int:
    path = Path(args.check) if args.check else newest_calibration()
    spec = HardwareSpec.load(path)
    info = spec.calibration or {}
    if not info.get("model_path"):
        raise ValueError(f"{path} holds no calibration (`quill cost calibrate` writes one)")
    cases = held_out_cases(
        args.max_batch or 48, args.max_context or 1024, args.max_chunk or 1536, args.steps or 2
    )
    engine = engine_for(
        cases,
        args.model or info["model_path"],
        info.get("dtype", "auto"),
        args.device,
        args.load_format,
        args.tokenizer,
        quantization=info.get("quantization", "none"),
    )
    reasons = stale_reasons(info, current_key(weight_formats(engine.runner.model)))
    steps = Sweep(engine).run(cases, "held-out steps", progress=not args.no_progress)
    cost = CostModel(calibrated_model(spec, str(engine.model_path)), spec)
    predicted = [cost.price(BatchShape.from_seqs(s.seqs)).predicted_s for s in steps]
    summary = error_summary_by_kind(steps, predicted)
    print(f"{path}: fitted {info.get('date', '?')} on {info.get('fitted_steps', '?')} steps")
    fitted = (info.get("fit_error") or {}).get("all") or {}
    if fitted:
        print(f"  error on its own steps: median {fitted['median']:.1%}, p90 {fitted['p90']:.1%}")
    for kind in ("all", "decode", "prefill", "mixed"):
        s = summary[kind]
        if s["steps"]:
            print(f"  held-out {kind:8s} {s['steps']:3d} steps: median {s['median']:.1%}, "
                  f"p90 {s['p90']:.1%}")  # fmt: skip
    if reasons:
        print("  stale for this process: " + "; ".join(reasons))
    else:
        print("  fresh: its key (native library, CPU, torch, weight formats) is this process's")
    if args.out:
        report = {"file": str(path), "held_out": summary, "stale": reasons}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if reasons else 0
