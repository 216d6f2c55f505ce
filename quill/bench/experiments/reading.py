"""Experiment 1, reading and writing: taking in a prompt of L tokens is one pass through the
model; writing a reply of L tokens is L passes. This times both on the real engine and sets
them beside the cost model, with the course's table (passes, seconds of arithmetic, seconds of
movement, what limits each) for this machine and model.

Writing is timed as decode steps at a few contexts, integrated over the L contexts a reply
passes through (a 2048-token reply run for real would take minutes); for short replies the
reply is also run for real, which checks the integration.
"""

from __future__ import annotations

import random
import time

from quill.bench.experiments.context import Settings
from quill.bench.experiments.engine import Needs
from quill.bench.experiments.measure import measure_cases
from quill.bench.experiments.report import Section, Table, num, pct, seconds, times
from quill.bench.experiments.stats import integrate_steps, median, relative_error
from quill.cost.sweep import Case
from quill.cost.table import price_decode, price_prefill

NAME = "reading"
TITLE = "Reading and writing: a prompt in one pass, a reply in one pass per token"


def lengths(settings: Settings) -> list[int]:
    return [16, 64, 256, 1024] if settings.quick else [16, 32, 64, 128, 256, 512, 1024, 2048]


def real_reply_lengths(settings: Settings) -> list[int]:
    return [16] if settings.quick else [16, 64]


def _cases(settings: Settings) -> tuple[list[Case], list[Case]]:
    ls = lengths(settings)
    # A reply of L tokens after a prompt of L runs decodes at contexts L .. 2L-1.
    contexts = sorted({c for n in ls for c in (n, 2 * n)})
    steps = 2 if settings.quick else 3
    decodes = [Case(1, c, steps=steps, warmup=1) for c in contexts]
    prefills = [
        Case(chunks=1, chunk=n, steps=1 if settings.quick or n >= 1024 else 2, warmup=1) for n in ls
    ]
    return decodes, prefills


def needs(ctx) -> Needs:
    settings = ctx.settings
    decodes, prefills = _cases(settings)
    longest = max(real_reply_lengths(settings))
    return Needs(decodes + prefills, budget=longest, seqs=1, kv_tokens=2 * longest + 1)


def course_rows(cm, tokens: list[int]) -> list[dict]:
    """The course's table at batch 1: for each L, reading an L-token prompt (one pass) and
    writing an L-token reply after it (L passes), as `quill cost` prices them."""
    return [
        {
            "tokens": n,
            "read": price_prefill(cm, n, 1, n).as_dict(),
            "write": price_decode(cm, n, n, 1).as_dict(),
        }
        for n in tokens
    ]


def _real_reply(engine, n: int, rng: random.Random) -> dict:
    """A prompt of n random tokens and a reply of n, for real; every token timestamped."""
    from quill.bench.client import random_prompt
    from quill.contract.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    sent = time.monotonic()
    engine.add_request(random_prompt(n, rng, range(100, 40000)), params, request_id=f"reply-{n}")
    stamps: list[float] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.monotonic()
        for out in outputs:
            stamps += [now] * len(out.outputs[0].delta_token_ids)
    return {"ttft_s": stamps[0] - sent, "write_s": stamps[-1] - stamps[0], "tokens": len(stamps)}


def run(ctx) -> dict:
    settings = ctx.settings
    decodes, prefills = _cases(settings)
    measured = measure_cases(ctx, decodes + prefills, "reading and writing")
    decode_rows, prefill_rows = measured[: len(decodes)], measured[len(decodes) :]
    # Each case's steps run at contexts context+warmup .. : the middle one stands for them.
    points = [
        (c.context + c.warmup + (c.steps - 1) / 2, r["measured_s"])
        for c, r in zip(decodes, decode_rows)
    ]
    cm = ctx.cost
    rows = course_rows(cm, lengths(settings))
    for row, pre in zip(rows, prefill_rows):
        n = row["tokens"]
        row["read"]["measured_s"] = pre["measured_s"]
        row["write"]["measured_s"] = integrate_steps(points, n, n)
    rng = random.Random(settings.seed)
    replies = []
    for n in real_reply_lengths(settings):
        real = _real_reply(ctx.engine, n, rng)
        # The reply's first token comes with the prompt's pass; the other n-1 passes run at
        # contexts n .. 2n-2.
        real["integrated_s"] = integrate_steps(points, n, n - 1)
        real["tokens_asked"] = n
        replies.append(real)
    return {
        "rows": rows,
        "decode_steps": [
            {"context": c, "measured_s": s, "predicted_s": r["predicted_s"]}
            for (c, s), r in zip(points, decode_rows)
        ],
        "prefill_steps": prefill_rows,
        "real_replies": replies,
        "weight_bytes": cm.weight_bytes,
        "ridge_ops_per_byte": cm.ridge_ops_per_byte,
    }


def describe(result: dict) -> Section:
    rows = result["rows"]
    measured_table = Table(
        [
            "tokens L",
            "read: measured",
            "read: predicted",
            "read: roofline floor",
            "write: measured",
            "write: predicted",
            "write: roofline floor",
            "write / read, measured",
        ],
        [
            [
                str(r["tokens"]),
                seconds(r["read"]["measured_s"]),
                f"{seconds(r['read']['time_s'])} ({pct(_err(r['read']))})",
                seconds(r["read"]["roofline_s"]),
                seconds(r["write"]["measured_s"]),
                f"{seconds(r['write']['time_s'])} ({pct(_err(r['write']))})",
                seconds(r["write"]["roofline_s"]),
                times(r["write"]["measured_s"] / r["read"]["measured_s"]),
            ]
            for r in rows
        ],
        "Read: one prefill pass of L tokens (measured: median engine step). Write: L decode "
        "passes at batch 1, contexts L .. 2L-1 (measured: decode steps timed at "
        f"{len(result['decode_steps'])} contexts and integrated). Predicted: the calibrated cost "
        "model (its error in brackets).",
    )
    course = Table(
        [
            "L",
            "phase",
            "passes",
            "GFLOP",
            "GB moved",
            "FLOP/byte",
            "arithmetic (FLOPs / peak)",
            "movement (bytes / bandwidth)",
            "limited by",
        ],
        [
            [
                str(r["tokens"]),
                phase,
                str(p["passes"]),
                num(p["flops"] / 1e9),
                num(p["bytes"] / 1e9),
                num(p["ops_per_byte"]),
                seconds(p["arithmetic_s"]),
                seconds(p["movement_s"]),
                p["bound"],
            ]
            for r in rows
            for phase, p in (("read", r["read"]), ("write", r["write"]))
        ],
        "The course's table for this machine (quill.cost.table, as `quill cost` prints it): "
        "FLOPs, bytes and seconds are sums over the passes, seconds at the calibration's peak "
        f"rates; the ridge is {num(result['ridge_ops_per_byte'])} FLOP/byte.",
    )
    tables = [measured_table, course]
    if result["real_replies"]:
        tables.append(
            Table(
                ["reply tokens", "written for real", "integrated from step times", "difference"],
                [
                    [
                        str(r["tokens_asked"]),
                        seconds(r["write_s"]),
                        seconds(r["integrated_s"]),
                        pct(relative_error(r["integrated_s"], r["write_s"])),
                    ]
                    for r in result["real_replies"]
                ],
                "A check of the integration: replies generated for real (first to last token, "
                "L-1 passes) against the same passes integrated from the measured steps.",
            )
        )
    big, small = rows[-1], rows[0]
    ratio = big["write"]["measured_s"] / big["read"]["measured_s"]
    caption = (
        f"Seconds to read (one pass) and to write (one pass per token) L tokens at batch 1, "
        f"measured (dots) and predicted (lines; dotted: roofline floor). At L = {big['tokens']} "
        f"reading took {seconds(big['read']['measured_s'])} and writing "
        f"{seconds(big['write']['measured_s'])}, {times(ratio)} as long."
    )
    read_err = median([abs(_err(r["read"])) for r in rows])
    write_err = median([abs(_err(r["write"])) for r in rows])
    floor = big["write"]["measured_s"] / big["write"]["roofline_s"]
    reading = (
        f"Writing L tokens took {times(small['write']['measured_s'] / small['read']['measured_s'])}"
        f" as long as reading them at L = {small['tokens']} and {times(ratio)} at L = "
        f"{big['tokens']}. A prompt's pass multiplies every weight by all L tokens at once: "
        f"{num(big['read']['ops_per_byte'])} FLOP per byte moved at L = {big['tokens']}, "
        f"{big['read']['bound']}-bound on the roofline. A reply's pass reads all "
        f"{num(result['weight_bytes'] / 1e6)} MB of weights for one token: "
        f"{num(big['write']['ops_per_byte'])} FLOP per byte, {big['write']['bound']}-bound, and "
        f"the time grows with the number of passes, not with the work. The calibrated model "
        f"predicted reading within {pct(read_err, False)} and writing within "
        f"{pct(write_err, False)} (median over lengths); the roofline floor is "
        f"{times(floor)} below the measured writing time at L = {big['tokens']}: it leaves out "
        "the fixed cost of every step, and products of one row run far below the peak."
    )
    what = (
        f"Time to take in a prompt of L tokens (one prefill pass) against the time to write a "
        f"reply of L tokens (L decode passes, one sequence, context growing from L to 2L-1), "
        f"for L from {small['tokens']} to {big['tokens']}, measured on the engine and predicted "
        "by the cost model; then the course's table: for each length, passes, seconds of "
        "arithmetic and of movement, and which one limits the pass."
    )
    return Section(NAME, TITLE, what, tables, f"{NAME}.png", caption, reading)


def _err(phase: dict) -> float | None:
    return relative_error(phase["time_s"], phase["measured_s"])
