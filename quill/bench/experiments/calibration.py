"""This machine's calibration for the predictions: the saved one, or a quick one measured now.

A prediction on a CPU is only as good as the calibrated step model behind it (the roofline
alone is a floor several times below the truth). A clean machine has none saved, so rather
than fall back to a floor this measures a quick one, the way `quill cost calibrate --quick`
does but on the experiments' own float32, unquantized engine, and says so in the report.
"""

from __future__ import annotations

import time
from pathlib import Path

from quill.bench.experiments.engine import DTYPE, Needs, build_engine
from quill.cost.hardware import HardwareSpec


def describe_spec(spec: HardwareSpec, path: str | None, source: str) -> dict:
    """What the report says about the calibration: where it came from, when, how well it fit."""
    cal = spec.calibration or {}
    return {
        "source": source,
        "path": path,
        "name": spec.name,
        "date": cal.get("date"),
        "fitted_steps": cal.get("fitted_steps"),
        "fit_error": cal.get("fit_error", {}).get("all"),
        "flops": spec.flops.get("float32"),
        "memory_bandwidth": spec.memory_bandwidth,
        "memory_capacity": spec.memory_capacity,
        "coefficients": spec.coefficients,
        "torch": cal.get("torch"),
    }


def load_or_calibrate(ctx) -> tuple[HardwareSpec, dict]:
    """(spec, description): `--hardware`, else the newest saved float32 calibration, else (or
    with `--recalibrate`) a quick calibration measured now."""
    from quill.cost.live import find_calibration_file

    settings = ctx.settings
    if settings.hardware:
        spec = HardwareSpec.resolve(settings.hardware)
        return spec, describe_spec(spec, settings.hardware, "given with --hardware")
    found = None if settings.recalibrate else find_calibration_file(DTYPE)
    if found is not None:
        spec = HardwareSpec.load(found)
        return spec, describe_spec(spec, str(found), "saved on this machine")
    reason = "asked for with --recalibrate" if settings.recalibrate else "none was saved"
    ctx.log(f"calibrating this machine now (quick; {reason})")
    started = time.perf_counter()
    spec = quick_calibration(ctx)
    out = save_path(ctx, found_none=not settings.recalibrate)
    spec.save(out)
    info = describe_spec(spec, str(out), f"measured now, quick ({reason})")
    info["seconds"] = time.perf_counter() - started
    return spec, info


def save_path(ctx, found_none: bool) -> Path:
    """Where a calibration made here goes: where `quill cost calibrate` would save it when the
    machine had none (so later commands find it), else beside the experiments' figures (a
    deliberate recalibration must not replace the machine's saved one)."""
    from quill.cost.calibrate import default_out

    if found_none:
        path = default_out(DTYPE)
    else:
        path = Path(ctx.out_dir) / f"calibration-{DTYPE}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def quick_calibration(ctx) -> HardwareSpec:
    """`quill cost calibrate --quick`'s measurements and fit, on a float32 unquantized engine."""
    from quill.cost import microbench
    from quill.cost.calibrate import calibration_cases, fit_spec
    from quill.cost.sweep import Sweep

    cases = calibration_cases(64, 1536, 512, steps=1, warmup=1, quick=True)
    engine = build_engine([Needs(cases=cases)], ctx.model_dir, ctx.model)
    peaks = microbench.measure_peaks(
        ctx.model,
        engine.device,
        max(c.step_tokens for c in cases),
        engine.dtype,
        quick=True,
        log=lambda _: None,
    )
    steps = Sweep(engine, seed=ctx.settings.seed).run(
        cases, "calibration steps", progress=ctx.settings.progress
    )
    return fit_spec(engine, steps, peaks)
