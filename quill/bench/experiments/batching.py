"""Experiment 2, batching: one decode step serves every running sequence for one read of the
weights, so output tokens per second rise with the batch while the step stays movement-bound,
and flatten once arithmetic (or here, the KV cache's traffic) takes over. This times decode
steps of 1 to 128 sequences at a fixed context beside the cost model's roofline floor and its
calibrated prediction, and marks where memory for the KV cache caps the batch.
"""

from __future__ import annotations

from quill.bench.experiments.context import Settings
from quill.bench.experiments.engine import Needs
from quill.bench.experiments.measure import cost_figures, measure_cases
from quill.bench.experiments.report import Section, Table, num, pct, seconds, times
from quill.bench.experiments.stats import median, relative_error
from quill.cost.batch import BatchShape
from quill.cost.sweep import Case

NAME = "batching"
TITLE = "Batching: one read of the weights for every sequence in the step"
CONTEXT = 256
LARGEST_CURVE_BATCH = 4096  # the predicted curves run past every cap, to show where they bend


def batches(settings: Settings) -> list[int]:
    return [1, 4, 16, 64, 128] if settings.quick else [1, 2, 4, 8, 16, 32, 64, 128]


def _cases(settings: Settings) -> list[Case]:
    steps = 1 if settings.quick else 3
    return [Case(b, CONTEXT, steps=steps, warmup=1) for b in batches(settings)]


def needs(ctx) -> Needs:
    settings = ctx.settings
    return Needs(_cases(settings))


def arithmetic_from(cm, context: int, limit: int = 1 << 16) -> int | None:
    """The smallest decode batch the roofline calls arithmetic-bound (None up to `limit`)."""
    b = 1
    while b <= limit and cm.price(BatchShape.decodes(b, context)).bound != "arithmetic":
        b *= 2
    if b > limit:
        return None
    low = b // 2  # movement-bound at low (or 0), arithmetic at b: bisect between them
    while b - low > 1:
        mid = (low + b) // 2
        if cm.price(BatchShape.decodes(mid, context)).bound == "arithmetic":
            b = mid
        else:
            low = mid
    return b


def run(ctx) -> dict:
    cases = _cases(ctx.settings)
    measured = measure_cases(ctx, cases, "batching")
    cm = ctx.cost
    rows = []
    for case, m in zip(cases, measured):
        b = case.decodes
        rows.append(
            {
                "batch": b,
                **m,
                "tokens_per_s": b / m["measured_s"],
                "predicted_tokens_per_s": b / m["predicted_s"],
                "roofline_tokens_per_s": b / m["roofline_s"],
                "ops_per_byte": m["flops"] / m["bytes"],
            }
        )
    curve = []
    b = 1
    while b <= LARGEST_CURVE_BATCH:
        cost = cost_figures(cm.price(BatchShape.decodes(b, CONTEXT)))
        curve.append({"batch": b, **cost})
        b *= 2
    per_seq = CONTEXT + 1
    return {
        "context": CONTEXT,
        "rows": rows,
        "curve": curve,
        "arithmetic_from_batch": arithmetic_from(cm, CONTEXT),
        "ridge_ops_per_byte": cm.ridge_ops_per_byte,
        "pool_bytes": ctx.settings.kv_cache_memory,
        "pool_tokens": ctx.kv_pool_tokens(),
        "max_num_seqs": ctx.settings.max_num_seqs,
        "engine_max_batch": ctx.max_batch(per_seq),
        "cost_model_max_batch": _finite(cm.max_batch(per_seq)),
        "kv_bytes_per_token": cm.model.kv_bytes_per_token,
        "weight_bytes": cm.weight_bytes,
    }


def _finite(x: float) -> int | None:
    return None if x == float("inf") else int(x)


def describe(result: dict) -> Section:
    rows = result["rows"]
    table = Table(
        [
            "batch",
            "step: measured",
            "step: predicted",
            "step: roofline floor",
            "tokens/s: measured",
            "tokens/s: predicted",
            "tokens/s: roofline ceiling",
            "FLOP/byte",
            "roofline bound",
        ],
        [
            [
                str(r["batch"]),
                seconds(r["measured_s"]),
                _with_error(r["predicted_s"], r["measured_s"]),
                seconds(r["roofline_s"]),
                num(r["tokens_per_s"]),
                num(r["predicted_tokens_per_s"]),
                num(r["roofline_tokens_per_s"]),
                num(r["ops_per_byte"]),
                r["bound"],
            ]
            for r in rows
        ],
        f"Decode steps at a context of {result['context']} tokens per sequence (median of the "
        "measured steps; the prediction prices each step's exact shape, its error in brackets).",
    )
    first, last = rows[0], rows[-1]
    cross = result["arithmetic_from_batch"]
    cap, cm_cap = result["engine_max_batch"], result["cost_model_max_batch"]
    pool_gib = result["pool_bytes"] / (1 << 30)
    caps = (
        f"the server's KV pool ({num(pool_gib)} GiB, {result['pool_tokens']:,} tokens) and its "
        f"max_num_seqs ({result['max_num_seqs']}) let {cap} sequences of {result['context'] + 1} "
        "tokens run at once"
        + (
            f"; the cost model's own limit (90% of the machine's memory) is {cm_cap:,}"
            if cm_cap
            else ""
        )
    )
    caption = (
        f"Decode step time and output tokens/s against the batch at context {result['context']}: "
        f"measured (dots), calibrated prediction (solid), roofline (dotted). From batch "
        f"{first['batch']} to {last['batch']} the step grew "
        f"{times(last['measured_s'] / first['measured_s'])} and tokens/s "
        f"{times(last['tokens_per_s'] / first['tokens_per_s'])}. Vertical lines: where the "
        "roofline turns arithmetic-bound, and where KV memory caps the batch."
    )
    gains = [
        (a["batch"], b["batch"], b["tokens_per_s"] / a["tokens_per_s"] - 1)
        for a, b in zip(rows, rows[1:])
    ]
    early = gains[0]
    late = gains[-1]
    at_last = next((c for c in result["curve"] if c["batch"] == last["batch"]), None)
    kv_share = at_last["kv_bytes"] / at_last["bytes"] if at_last else None
    err = median([abs(relative_error(r["predicted_s"], r["measured_s"])) for r in rows])
    reading = (
        f"From batch {first['batch']} to {last['batch']} the step took "
        f"{times(last['measured_s'] / first['measured_s'])} as long and wrote "
        f"{times(last['tokens_per_s'] / first['tokens_per_s'])} the tokens per second "
        f"({num(first['tokens_per_s'])} to {num(last['tokens_per_s'])}): going from "
        f"{early[0]} to {early[1]} sequences gained {pct(early[2])}, going from {late[0]} to "
        f"{late[1]} gained {pct(late[2])}. "
        + (
            f"The roofline keeps the step movement-bound up to batch {cross - 1} and calls it "
            f"arithmetic-bound from {cross} (above {num(result['ridge_ops_per_byte'])} FLOP per "
            "byte)"
            if cross
            else "The roofline keeps the step movement-bound at every batch"
        )
        + (
            f"; at batch {last['batch']} the KV cache is {pct(kv_share, False)} of the bytes a "
            f"step moves (the weights, {num(result['weight_bytes'] / 1e6)} MB, are read once "
            "for the whole batch)"
            if kv_share is not None
            else ""
        )
        + f". The calibrated model's median error over these batches is {pct(err, False)}. "
        f"Memory: {caps}."
    )
    return Section(NAME, TITLE, _what(result), [table], f"{NAME}.png", caption, reading)


def _with_error(predicted: float, measured: float) -> str:
    return f"{seconds(predicted)} ({pct(relative_error(predicted, measured))})"


def _what(result: dict) -> str:
    rows = result["rows"]
    return (
        f"Decode step time and output tokens per second for {rows[0]['batch']} to "
        f"{rows[-1]['batch']} sequences decoding together, each at a context of "
        f"{result['context']} tokens, against the cost model's roofline (the floor: the longer "
        "of arithmetic and movement) and its calibrated prediction."
    )
