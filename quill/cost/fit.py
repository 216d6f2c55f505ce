"""Fitting the calibrated step-time model to measured steps, and scoring its predictions.

A CPU engine runs far from its roofline, so the time of a step is better told by a sum of
costs (a fixed cost, each sequence, the weights, the matrix FLOPs, the attention FLOPs, the KV
bytes) than by max(arithmetic, movement). Their rates are what `quill cost calibrate` fits here
from real steps, with a non-negative least-squares solver of our own (numpy only: a negative
seconds-per-FLOP would be a fit artefact, and scipy is not a dependency). Torch-free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from quill.cost.batch import BatchShape
from quill.cost.hardware import CALIBRATION_KEYS
from quill.cost.step import CostModel, StepCost

# Fitted columns, in order; the weight bytes are constant for one model, so they cannot be told
# apart from the per-step overhead and are split from the fitted intercept afterwards.
FIT_KEYS = ("overhead_s", "per_seq_s", "s_per_linear_flop", "s_per_attention_flop", "s_per_kv_byte")
# Optional: KV bytes per layer past which each byte also costs s_per_kv_byte_over_knee.
KNEE_KEYS = ("kv_knee_bytes_per_layer", "s_per_kv_byte_over_knee")


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """x >= 0 minimising ||a @ x - b||, by Lawson and Hanson's active-set method.

    Columns are scaled to unit norm first: step features span 1 to 1e12, and an unscaled
    solve would let the large columns swamp the tolerance of the small ones.
    """
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    if a.ndim != 2 or b.shape != (a.shape[0],):
        raise ValueError(f"nnls needs a (m, n) matrix and an (m,) vector, got {a.shape}, {b.shape}")
    m, n = a.shape
    norms = np.linalg.norm(a, axis=0)
    usable = norms > 0
    scale = np.where(usable, norms, 1.0)
    a = a / scale
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * max(m, n) * max(1.0, np.abs(a).sum(axis=0).max())
    for _ in range(max_iter or 3 * n + 10):
        w = a.T @ (b - a @ x)
        candidates = ~passive & usable & (w > tol)
        if not candidates.any():
            break
        passive[np.argmax(np.where(candidates, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            # Step from x towards z until the first passive coefficient reaches zero; drop it.
            blocked = passive & (z <= 0)
            alpha = np.min(x[blocked] / (x[blocked] - z[blocked]))
            x = x + alpha * (z - x)
            passive &= x > 1e-12 * max(1.0, np.abs(x).max())
            x[~passive] = 0.0
    return x / scale


def robust_nnls(a: np.ndarray, b: np.ndarray, rounds: int = 3) -> np.ndarray:
    """NNLS with Huber reweighting: a step slowed by another process on a shared machine
    (noise is always a slowdown) loses weight instead of dragging every coefficient up."""
    weights = np.ones_like(b)
    x = nnls(a, b)
    for _ in range(rounds):
        residuals = np.abs(a @ x - b)
        limit = 2.5 * _scale(residuals, b)
        if limit == 0:
            break
        new = np.where(residuals <= limit, 1.0, limit / np.maximum(residuals, limit))
        if np.allclose(new, weights):
            break
        weights = new
        root = np.sqrt(weights)
        x = nnls(a * root[:, None], b * root)
    return x


def _scale(residuals: np.ndarray, b: np.ndarray) -> float:
    """A robust spread of the residuals (0 when they vanish): 1.4826 * their median."""
    scale = 1.4826 * float(np.median(np.abs(residuals)))
    return 0.0 if scale <= 1e-12 * max(1.0, float(np.abs(b).max())) else scale


def _huber(residuals: np.ndarray, delta: float) -> float:
    r = np.abs(residuals)
    if delta == 0:
        return float((r * r).sum())
    return float(np.where(r <= delta, 0.5 * r * r, delta * (r - 0.5 * delta)).sum())


# -- features ------------------------------------------------------------------------------------
def features(cost: StepCost, shape: BatchShape) -> list[float]:
    """One step's FIT_KEYS columns."""
    return [
        1.0,
        float(shape.num_seqs),
        cost.linear_flops_effective,
        cost.attention_flops,
        cost.kv_read_bytes + cost.kv_write_bytes,
    ]


def fit_calibration(
    costs: Sequence[StepCost],
    shapes: Sequence[BatchShape],
    durations: Sequence[float],
    weight_bytes: float,
    max_s_per_weight_byte: float,
    num_layers: int | None = None,
) -> dict[str, float]:
    """Coefficients (CALIBRATION_KEYS, and KNEE_KEYS when a knee pays) minimising the
    squared *relative* error over the steps.

    Relative, because steps run from milliseconds to seconds and the error that matters is a
    fraction of each: unweighted, the few longest steps would set every coefficient. The fitted
    intercept is split into weight streaming (at most `max_s_per_weight_byte`, the measured
    rate) and the rest, the overhead, so the spec also prices models of another size.

    With `num_layers`, KV traffic may also get a knee: past some bytes per layer (on a CPU,
    about where one layer's gathered KV outgrows the last-level cache) every further byte costs
    more. The knee is searched over the steps' own KV sizes and kept only if it lowers the
    robust loss by more than its two extra parameters are worth (Akaike's criterion).
    """
    y = np.asarray(durations, dtype=np.float64)
    if len(y) < len(FIT_KEYS):
        raise ValueError(f"need at least {len(FIT_KEYS)} steps to fit, got {len(y)}")
    if (y <= 0).any():
        raise ValueError("step durations must be positive")
    base = np.array([features(c, s) for c, s in zip(costs, shapes)], dtype=np.float64)
    ones = np.ones_like(y)
    x = robust_nnls(base / y[:, None], ones)
    delta = 2.5 * _scale(base @ x / y - 1, ones)
    best = (_aic(_huber(base @ x / y - 1, delta), len(y), len(FIT_KEYS)), None, x)
    kv = base[:, -1]
    # A knee needs steps on both sides of it: too few steps and it would fit noise.
    enough = num_layers and len(y) >= 3 * (len(FIT_KEYS) + 2)
    levels = np.unique(kv[kv > 0] / num_layers) if enough else np.array([])
    for knee in levels[:-3]:  # leave steps above the knee to set its slope
        a = np.column_stack([base, np.maximum(kv - knee * num_layers, 0.0)])
        xk = robust_nnls(a / y[:, None], ones)
        score = _aic(_huber(a @ xk / y - 1, delta), len(y), len(FIT_KEYS) + 2)
        if score < best[0] and xk[-1] > 0:
            best = (score, float(knee), xk)
    _, knee, x = best
    fitted = dict(zip(FIT_KEYS, (float(v) for v in x)))
    intercept = fitted.pop("overhead_s")
    s_weight = min(max_s_per_weight_byte, intercept / weight_bytes) if weight_bytes > 0 else 0.0
    out = {
        "overhead_s": max(0.0, intercept - s_weight * weight_bytes),
        "s_per_weight_byte": s_weight,
        **fitted,
    }
    out = {k: out[k] for k in CALIBRATION_KEYS}
    if knee is not None:
        out.update(kv_knee_bytes_per_layer=knee, s_per_kv_byte_over_knee=float(x[-1]))
    return out


def _aic(loss: float, n: int, k: int) -> float:
    # Relative errors under ~1e-5 are rounding, not signal: floor them so that exact data
    # does not choose a knee by a difference in the last digits.
    return n * math.log(max(loss / n, 1e-10)) + 2 * k


def predict(
    coefficients: dict[str, float], cost: StepCost, shape: BatchShape, num_layers: int = 0
) -> float:
    """The additive prediction by hand (what CostModel.price computes with a calibration)."""
    c = coefficients
    kv = cost.kv_read_bytes + cost.kv_write_bytes
    knee = c.get("kv_knee_bytes_per_layer", 0.0) * num_layers
    return (
        c["overhead_s"]
        + c["per_seq_s"] * shape.num_seqs
        + c["s_per_weight_byte"] * cost.weight_bytes
        + c["s_per_linear_flop"] * cost.linear_flops_effective
        + c["s_per_attention_flop"] * cost.attention_flops
        + c["s_per_kv_byte"] * kv
        + c.get("s_per_kv_byte_over_knee", 0.0) * max(0.0, kv - knee)
        + cost.communication_s
    )


# -- scoring ---------------------------------------------------------------------------------------
def relative_errors(predicted: Sequence[float], measured: Sequence[float]) -> np.ndarray:
    p = np.asarray(predicted, dtype=np.float64)
    m = np.asarray(measured, dtype=np.float64)
    return np.abs(p - m) / m


def error_summary(predicted: Sequence[float], measured: Sequence[float]) -> dict:
    """Median and p90 of |predicted - measured| / measured (fractions), and the step count."""
    errors = relative_errors(predicted, measured)
    if errors.size == 0:
        return {"steps": 0, "median": math.nan, "p90": math.nan}
    return {
        "steps": int(errors.size),
        "median": float(np.median(errors)),
        "p90": float(np.quantile(errors, 0.9)),
    }


def price_steps(
    model: CostModel, seqs_per_step: Sequence[Sequence[tuple[int, int, bool, bool]]]
) -> tuple[list[BatchShape], list[StepCost]]:
    """Shapes and costs of recorded steps given as (start, num_tokens, samples, is_decode)."""
    shapes = [BatchShape.from_seqs(seqs) for seqs in seqs_per_step]
    return shapes, [model.price(s) for s in shapes]


def error_summary_by_kind(steps, predicted: Sequence[float]) -> dict:
    """error_summary over all measured steps (`.duration`, `.kind`) and per kind."""
    measured = [s.duration for s in steps]
    out = {"all": error_summary(predicted, measured)}
    for kind in ("decode", "prefill", "mixed"):
        idx = [i for i, s in enumerate(steps) if s.kind == kind]
        out[kind] = error_summary([predicted[i] for i in idx], [measured[i] for i in idx])
    return out
