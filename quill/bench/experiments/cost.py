"""Experiment 3, cost per word, quiet against busy: what a million output tokens cost on this
machine with one request at a time and with the largest batch its KV memory holds, measured
and predicted, and where the difference comes from.

Almost all of it is the weights: a decode step reads every weight once however many
sequences share it, so at batch 1 each token carries the whole read (and the step's fixed
cost), and at batch B a B-th of it. The cost model splits a step's predicted time into what
the batch shares (the fixed cost, the weights) and what each sequence brings (its FLOPs, its
KV cache), which says how much of the saving is the sharing.
"""

from __future__ import annotations

from quill.bench.experiments.context import Settings
from quill.bench.experiments.engine import Needs
from quill.bench.experiments.measure import measure_cases
from quill.bench.experiments.report import (
    Section,
    Table,
    dollars,
    megabytes,
    num,
    pct,
    seconds,
    times,
)
from quill.bench.experiments.stats import per_million, relative_error
from quill.cost.batch import BatchShape
from quill.cost.sweep import Case

NAME = "cost"
TITLE = "Cost per word, quiet against busy"
PROMPT, REPLY = 256, 256


def _mid() -> int:
    # Decode time is close to linear in the context, so the middle of the reply stands for
    # the average step of the whole reply.
    return PROMPT + REPLY // 2


def _cases(settings: Settings, busy: int) -> list[Case]:
    steps = 1 if settings.quick else 3
    return [Case(1, _mid(), steps=steps, warmup=1), Case(busy, _mid(), steps=steps, warmup=1)]


def needs(ctx) -> Needs:
    return Needs(_cases(ctx.settings, ctx.max_batch(PROMPT + REPLY)))


def split(cm, batch: int, context: int) -> dict:
    """A decode step's predicted seconds split into what the batch shares (the step's fixed
    cost and the weight read) and what its sequences bring (everything else), and its bytes
    into weights and KV cache."""
    cost = cm.price(BatchShape.decodes(batch, context))
    c = cm.hardware.coefficients
    if c is not None:
        shared = c["overhead_s"] + c["s_per_weight_byte"] * cost.weight_bytes
    else:  # uncalibrated: the roofline's movement of the weights plus the fixed overhead
        shared = cm.hardware.step_overhead_s + cost.weight_bytes / cm.hardware.memory_bandwidth
    shared = min(shared, cost.predicted_s)
    return {
        "batch": batch,
        "predicted_s": cost.predicted_s,
        "shared_s": shared,
        "own_s": cost.predicted_s - shared,
        "weight_bytes": cost.weight_bytes,
        "kv_bytes": cost.kv_read_bytes + cost.kv_write_bytes,
        "activation_bytes": cost.activation_bytes,
    }


def sharing_fraction(quiet: dict, busy: dict) -> float | None:
    """The share of the fall in predicted seconds per token, from batch 1 to batch B, that
    comes from dividing the shared part of a step by more sequences."""
    b = busy["batch"]
    per_token_quiet = quiet["predicted_s"] / quiet["batch"]
    per_token_busy = busy["predicted_s"] / b
    fall = per_token_quiet - per_token_busy
    if fall <= 0:
        return None
    return (quiet["shared_s"] / quiet["batch"] - busy["shared_s"] / b) / fall


def run(ctx) -> dict:
    settings = ctx.settings
    busy = ctx.max_batch(PROMPT + REPLY)
    measured = measure_cases(ctx, _cases(settings, busy), "cost per token")
    cm = ctx.cost
    loads = []
    for load, m in zip(("quiet", "busy"), measured):
        b = m["decodes"]
        loads.append(
            {
                "load": load,
                "batch": b,
                "measured_step_s": m["measured_s"],
                "predicted_step_s": m["predicted_s"],
                "measured": per_million(m["measured_s"] / b, settings.price_per_hour),
                "predicted": per_million(m["predicted_s"] / b, settings.price_per_hour),
                "split": split(cm, b, _mid()),
            }
        )
    return {
        "prompt_tokens": PROMPT,
        "reply_tokens": REPLY,
        "context": _mid(),
        "price_per_hour": settings.price_per_hour,
        "loads": loads,
        "sharing_fraction": sharing_fraction(loads[0]["split"], loads[1]["split"]),
        "pool_bytes": settings.kv_cache_memory,
        "max_num_seqs": settings.max_num_seqs,
        "cost_model_max_batch": _finite(cm.max_batch(PROMPT + REPLY)),
    }


def _finite(x: float) -> int | None:
    return None if x == float("inf") else int(x)


def describe(result: dict) -> Section:
    quiet, busy = result["loads"]
    price = result["price_per_hour"]
    rows = []
    for d in result["loads"]:
        b, s = d["batch"], d["split"]
        usd_measured, usd_predicted = (d[k]["usd_per_million"] for k in ("measured", "predicted"))
        rows.append(
            [
                f"{d['load']} (batch {b})",
                seconds(d["measured_step_s"]),
                seconds(d["predicted_step_s"]),
                num(d["measured"]["hours_per_million"]),
                num(d["predicted"]["hours_per_million"]),
                f"{dollars(usd_measured)}",
                f"{dollars(usd_predicted)} ({pct(relative_error(usd_predicted, usd_measured))})",
                megabytes(s["weight_bytes"] / b),
                megabytes(s["kv_bytes"] / b),
                seconds(s["shared_s"] / b),
                seconds(s["own_s"] / b),
            ]
        )
    table = Table(
        [
            "load",
            "step: measured",
            "step: predicted",
            "hours per M tokens: measured",
            "predicted",
            f"$ per M tokens at {dollars(price)}/h: measured",
            "predicted",
            "weight bytes per token",
            "KV bytes per token",
            "shared s per token (fixed cost + weights)",
            "own s per token (FLOPs, KV, per sequence)",
        ],
        rows,
        f"Replies of {result['reply_tokens']} tokens after {result['prompt_tokens']}-token "
        f"prompts; decode steps measured at the reply's middle (context {result['context']}). "
        f"{dollars(price)} per hour is an example price (about a cloud 2-vCPU VM's; "
        "`--price-per-hour` sets another). The last four columns are the cost model's.",
    )
    ratio = quiet["measured"]["usd_per_million"] / busy["measured"]["usd_per_million"]
    caption = (
        f"Left: dollars at {dollars(price)}/h per million output tokens, one request at a time "
        f"against batch {busy['batch']}, measured and predicted; middle: the predicted seconds "
        "per token split into what the batch shares and what each sequence brings; right: the "
        f"bytes each token moves. Busy was {times(ratio)} cheaper: "
        f"{dollars(quiet['measured']['usd_per_million'])} against "
        f"{dollars(busy['measured']['usd_per_million'])} per million tokens."
    )
    what = (
        "Seconds and dollars per million output tokens at batch 1 (a quiet server) and at the "
        "largest batch whose KV cache fits (a busy one), measured and predicted, and how much "
        "of the difference comes from sharing the weight reads."
    )
    return Section(NAME, TITLE, what, [table], f"{NAME}.png", caption, _reading(result))


def _reading(result: dict) -> str:
    quiet, busy = result["loads"]
    b, qs, bs = busy["batch"], quiet["split"], busy["split"]
    usd = {
        k: (quiet[k]["usd_per_million"], busy[k]["usd_per_million"])
        for k in ("measured", "predicted")
    }
    saved = qs["shared_s"] - bs["shared_s"] / b
    fall = qs["predicted_s"] - bs["predicted_s"] / b
    weights_b, kv_b = bs["weight_bytes"] / b, bs["kv_bytes"] / b
    text = (
        f"At {dollars(result['price_per_hour'])} an hour, a million output tokens cost "
        f"{dollars(usd['measured'][0])} one request at a time "
        f"({num(quiet['measured']['hours_per_million'])} machine-hours) and "
        f"{dollars(usd['measured'][1])} at batch {b} "
        f"({num(busy['measured']['hours_per_million'])} hours): "
        f"{times(usd['measured'][0] / usd['measured'][1])} cheaper (predicted "
        f"{times(usd['predicted'][0] / usd['predicted'][1])}). At batch 1 each token carries the "
        f"whole weight read ({megabytes(qs['weight_bytes'])}) and the step's fixed cost: "
        f"{pct(qs['shared_s'] / qs['predicted_s'], False)} of its predicted time. At batch {b} "
        f"it carries {megabytes(weights_b)} of weights, "
        f"{'less' if weights_b < kv_b else 'more'} than its own {megabytes(kv_b)} of KV cache. "
    )
    if result["sharing_fraction"] is not None and result["sharing_fraction"] <= 1:
        text += (
            f"The cost model puts {pct(result['sharing_fraction'], False)} of the fall in "
            f"seconds per token ({seconds(saved)} of {seconds(fall)}) on sharing the weight "
            "read and the fixed cost"
        )
    else:
        text += (
            f"By the cost model, sharing the weight read and the fixed cost saves "
            f"{seconds(saved)} per token, more than the whole fall ({seconds(fall)})"
        )
    text += (
        f"; each token's own part went from {seconds(qs['own_s'])} to {seconds(bs['own_s'] / b)}."
        f" Batch {b} is the most that a {num(result['pool_bytes'] / (1 << 30))} GiB KV pool "
        f"and max_num_seqs {result['max_num_seqs']} hold at "
        f"{result['prompt_tokens'] + result['reply_tokens']} tokens per sequence"
    )
    cap = result.get("cost_model_max_batch")
    return text + (
        f" (the cost model's limit, 90% of this machine's memory: {cap:,})." if cap else "."
    )
