"""Real engine steps of chosen shapes, each beside the cost model's price of the same shape.

The sweep (quill.cost.sweep) times the steps; this prices every measured step's exact
composition (its contexts grow by one token a step) with the calibrated model and its
roofline floor, and keeps the median of each case's steps: on a shared machine a single step
can be slowed by anything else running, and the median shrugs off one such step.
"""

from __future__ import annotations

from quill.bench.experiments.stats import median
from quill.cost import fit
from quill.cost.sweep import Case, Sweep


def price_seqs(cm, seqs: list[tuple[int, int, bool, bool]]) -> dict:
    """The cost model's figures for one step's composition."""
    _, (cost,) = fit.price_steps(cm, [seqs])
    return cost_figures(cost)


def cost_figures(cost) -> dict:
    return {
        "predicted_s": cost.predicted_s,
        "roofline_s": cost.roofline_s,
        "arithmetic_s": cost.arithmetic_s,
        "movement_s": cost.movement_s,
        "bound": cost.bound,
        "flops": cost.flops,
        "bytes": cost.bytes_moved,
        "weight_bytes": cost.weight_bytes,
        "kv_bytes": cost.kv_read_bytes + cost.kv_write_bytes,
    }


def measure_cases(ctx, cases: list[Case], desc: str) -> list[dict]:
    """One row per case, in order: the median measured step and the median priced one."""
    sweep = Sweep(ctx.engine, seed=ctx.settings.seed)
    steps = sweep.run(cases, desc, progress=ctx.settings.progress)
    cm = ctx.cost
    rows = []
    for case in cases:
        mine = [s for s in steps if s.case == case.label]
        priced = [price_seqs(cm, s.seqs) for s in mine]
        row = {
            "case": case.label,
            "decodes": case.decodes,
            "context": case.context,
            "chunk": case.chunk,
            "durations_s": [s.duration for s in mine],
            "measured_s": median([s.duration for s in mine]),
        }
        for key in ("predicted_s", "roofline_s", "arithmetic_s", "movement_s", "flops", "bytes"):
            row[key] = median([p[key] for p in priced])
        row["bound"] = priced[len(priced) // 2]["bound"]
        rows.append(row)
    return rows
