"""Fitting a calibration again on steps a serving engine recorded (`quill serve
--record-steps`; `quill cost calibrate --from-steps`): its coefficients, the scatter of its
steps around them, and the host's time between steps. What a step costs while serving, where
the sweep of `quill cost calibrate` (calibrate.py) measures an engine alone.
"""

from __future__ import annotations

import math
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from quill.cost import fit
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec, bytes_per_element, kv_bytes_per_element
from quill.cost.step import CostModel
from quill.cost.sweep import MeasuredStep


def step_time_ratios(steps: list[MeasuredStep], predicted: list[float]) -> list[float]:
    """Percentiles 0, 1, ..., 100 of measured / predicted over the fitted steps: how far a
    step strays from the model's price (the simulator draws from it: quill/sim/jitter.py)."""
    import numpy as np

    ratios = [s.duration / p for s, p in zip(steps, predicted) if p > 0]
    if not ratios:
        return []
    return [round(float(x), 5) for x in np.percentile(ratios, range(101))]


MIN_KIND_STEPS = 20  # a kind's own ratios only from this many of its steps


def step_time_ratios_by_kind(
    steps: list[MeasuredStep], predicted: list[float]
) -> dict[str, list[float]]:
    """`step_time_ratios` of each kind of step (decode, prefill, mixed) with enough of them:
    one step model leaves each kind its own bias (a fit dominated by the many short decodes
    prices the few long prompt steps low), and what a queue multiplies is the long steps'."""
    out = {}
    for kind in ("decode", "prefill", "mixed"):
        mine = [(s, p) for s, p in zip(steps, predicted) if s.kind == kind]
        if len(mine) >= MIN_KIND_STEPS:
            out[kind] = step_time_ratios([s for s, _ in mine], [p for _, p in mine])
    return out


MEMORY_LAGS = 40  # steps apart: the pairs the memory is fitted on
MIN_MEMORY_STEPS = 100


def step_time_memory(steps: list[MeasuredStep], predicted: list[float]) -> dict | None:
    """How long a step's stray from the model's price lasts: slow steps come in patches (a
    shared host's speed moves for seconds at a time; recorded steps' ratios correlate 0.7-0.8
    with the next step's and still ~0.3 thirty steps on), and a patch is what stretches one
    request's whole reply, where independent draws average out over its steps.

    Each step's ratio becomes a normal score within its kind (the rank among its kind's
    ratios: the simulator draws each kind's ratios at a shared quantile), and the
    correlation of two steps' scores Δt seconds apart is fitted as shared * exp(-Δt / seconds):
    a part `shared` of each step's score is a slowly wandering level, the rest its own. None
    where the steps carry no start times or too few of them, or the fit finds no memory."""
    from statistics import NormalDist

    import numpy as np

    timed = [(s, p) for s, p in zip(steps, predicted) if p > 0 and s.start is not None]
    if len(timed) < MIN_MEMORY_STEPS:
        return None
    ratios = np.array([s.duration / p for s, p in timed])
    starts = np.array([s.start for s, _ in timed])
    scores = np.zeros(len(timed))
    normal = NormalDist()
    for kind in {s.kind for s, _ in timed}:
        mine = np.array([i for i, (s, _) in enumerate(timed) if s.kind == kind])
        ranks = np.argsort(np.argsort(ratios[mine], kind="stable"), kind="stable")
        scores[mine] = [normal.inv_cdf((r + 0.5) / len(mine)) for r in ranks]
    scores -= scores.mean()
    scores /= scores.std() or 1.0
    lags = range(1, min(MEMORY_LAGS, len(timed) // 4) + 1)
    corr = np.array([np.mean(scores[:-k] * scores[k:]) for k in lags])
    apart = np.array([np.mean(starts[k:] - starts[:-k]) for k in lags])
    best = None
    for seconds in np.geomspace(1e-3, 1e3, 241):
        decay = np.exp(-apart / seconds)
        shared = float(np.clip(np.dot(corr, decay) / np.dot(decay, decay), 0.0, 0.99))
        error = float(np.sum((corr - shared * decay) ** 2))
        if best is None or error < best[0]:
            best = (error, shared, float(seconds))
    _, shared, seconds = best
    if shared * math.exp(-apart[0] / seconds) < 0.05:  # not even the next step remembers
        return None
    return {"shared": round(shared, 4), "seconds": round(seconds, 4), "steps": len(timed)}


def refit_spec(base: HardwareSpec, model: ModelSpec, steps: list[MeasuredStep]) -> HardwareSpec:
    """`base` with its coefficients fitted again on other steps (its rates kept)."""
    roofline = replace(base, calibration=None, step_overhead_s=0.0)
    shapes, costs = fit.price_steps(CostModel(model, roofline), [s.seqs for s in steps])
    durations = [s.duration for s in steps]
    coefficients = fit.fit_calibration(
        costs, shapes, durations, model.weight_bytes, 1 / base.memory_bandwidth, model.num_layers
    )
    layers = model.num_layers or 0
    predicted = [fit.predict(coefficients, c, s, layers) for c, s in zip(costs, shapes)]
    calibration = dict(base.calibration or {})
    for key in ("kv_knee_bytes_per_layer", "s_per_kv_byte_over_knee"):
        calibration.pop(key, None)
    calibration.update(
        coefficients,
        fitted_steps=len(steps),
        fit_error=fit.error_summary_by_kind(steps, predicted),
        step_time_ratios=step_time_ratios(steps, predicted),
        step_time_ratios_by_kind=step_time_ratios_by_kind(steps, predicted),
        step_time_memory=step_time_memory(steps, predicted),
        date=datetime.now(UTC).isoformat(timespec="seconds"),
    )
    return replace(base, calibration=calibration)


def calibrated_model(spec: HardwareSpec, model_path: str | None = None) -> ModelSpec:
    """The model as `spec` was calibrated on it (its dtype and KV cache dtype); `model_path`
    another of the same dtypes."""
    info = spec.calibration or {}
    model = ModelSpec.from_path(
        model_path or info["model_path"], bytes_per_element(info.get("dtype", "bfloat16"))
    )
    model.dtype = info.get("dtype", model.dtype)
    model.kv_bytes_per_element = kv_bytes_per_element(
        info.get("kv_cache_dtype", "auto"), model.dtype
    )
    return model


def recorded_steps(path: str | Path, skip: int = 0) -> list[MeasuredStep]:
    """The steps an engine recorded (`quill serve --record-steps FILE`), past the first
    `skip`, as measured steps to fit on."""
    from quill.engine.record import read_steps

    steps = []
    for record in read_steps(path)[skip:]:
        seqs = [tuple(x) for x in record["seqs"]]
        decodes = sum(1 for x in seqs if x[3])
        kind = "decode" if decodes == len(seqs) else "mixed" if decodes else "prefill"
        steps.append(
            MeasuredStep(
                f"step {record['step']}", kind, record["duration"], seqs, record.get("start")
            )
        )
    return steps


def step_gaps(records: list[dict], busy_s: float = 0.01) -> dict | None:
    """The host's time between back-to-back steps (one step's end to the next one's start,
    where under `busy_s`: the engine had work waiting), as base + per sequence of the step
    before (its outputs are processed then), least squares, neither below zero. It is outside
    every recorded step's duration, so a step model alone leaves it out."""
    import numpy as np

    timed = [r for r in records if "start" in r]
    pairs = [(len(a["seqs"]), b["start"] - a["start"] - a["duration"])
             for a, b in zip(timed, timed[1:])]  # fmt: skip
    pairs = [(n, g) for n, g in pairs if 0 <= g < busy_s]
    if len(pairs) < 10:
        return None
    seqs = np.array([n for n, _ in pairs], dtype=float)
    gaps = np.array([g for _, g in pairs])
    if np.ptp(seqs) > 0:
        slope, base = np.polyfit(seqs, gaps, 1)
    else:
        slope, base = 0.0, float(np.mean(gaps))
    if slope < 0:
        slope, base = 0.0, float(np.mean(gaps))
    if base < 0:
        base, slope = 0.0, float(np.sum(seqs * gaps) / np.sum(seqs * seqs))
    return {"base_s": float(base), "per_seq_s": float(slope), "steps": len(pairs)}
