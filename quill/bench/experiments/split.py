"""Experiment 5, the split for real: experiment 4's second repair measured on two instances.

Sixteen streams decode while 2,000-token prompts arrive, on two `quill serve` instances pinned
to one core each behind the router: (a) `--replicas 2`'s layout, two whole-request instances
each taking its prompts in chunks beside its share of the streams, against (b)
`--disaggregate 1:1`'s, one prefill instance (every prompt) handing the KV cache to one decode
instance (every reply). The sides alternate round after round. Beside them the simulator runs
the same items (`run_colocated(.., 2)`, `run_disaggregated(.., 1, 1)`) with this machine's
one-core calibration and the KV transfer rate measured through the split.

The instances run the engine's default dtype, unquantized, as the calibration (`quill cost
calibrate --quick --threads 1`, pinned to one core; measured once, then cached) prices them.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from quill.bench.experiments.engine import Needs
from quill.bench.experiments.report import Section, Table, megabytes, pct, seconds, times
from quill.bench.experiments.stats import percentile_or_none, relative_error
from quill.bench.routing import RouterThread

NAME = "split"
TITLE = "Disaggregation for real: a prefill and a decode instance against two colocated"
BUDGET = 256  # the colocated instances' token budget: prompts in chunks of 256
LONG_PROMPT = 2000
INSTANCE_FLAGS = ["--quantization", "none", "--max-num-batched-tokens", str(BUDGET),
                  "--kv-cache-memory", "1GiB", "--served-model-name", "smol",
                  "--log-level", "warning", "--no-access-log"]  # fmt: skip
SIDES = {"colocated": ("whole", "whole"), "split": ("prefill", "decode")}
LABELS = {"colocated": "(a) 2 colocated, chunks of 256", "split": "(b) 1 prefill + 1 decode"}


def needs(ctx) -> Needs | None:
    return None  # its own server processes, not the shared engine


def workload(quick: bool):
    """The streams start at once; the long prompts come late enough that every stream is
    decoding (on the split: its prompt handed over), a few seconds apart."""
    from quill.sim.workload import WorkItem

    streams, reply, long_prompts = (8, 128, 2) if quick else (16, 256, 3)
    items = [WorkItem(f"s{i}", 0.0, 32, reply) for i in range(streams)]
    items += [WorkItem(f"new{j}", 4.0 + 3.0 * j, LONG_PROMPT, 16) for j in range(long_prompts)]
    return sorted(items, key=lambda i: i.arrival_time)


def measure(records, items) -> dict:
    """The streams' gaps from the first long prompt's arrival on, the long prompts' TTFT, and
    (to set beside the simulator, which reports no per-stream split) every request's gaps."""
    from quill.bench.client import token_gaps

    records = sorted(records, key=lambda r: r.index)  # as the items were given
    failed = [r for r in records if not r.ok]
    first = min(r.scheduled for r, i in zip(records, items) if i.request_id.startswith("new"))
    streams, everyone, ttft_long, timeline = [], [], [], []
    for record, item in zip(records, items):
        if not record.ok:
            continue
        everyone += token_gaps(record)
        if item.request_id.startswith("s"):
            times_ = record.chunk_times
            for a, b in zip(times_, times_[1:]):
                if b > first:
                    streams.append(b - a)
                    timeline.append([round(b - first, 4), round(b - a, 4)])
        else:
            ttft_long.append(record.ttft)
    return {
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:3],
        "streams_itl_p50_s": percentile_or_none(streams, 50),
        "streams_itl_p99_s": percentile_or_none(streams, 99),
        "streams_longest_stall_s": max(streams, default=None),
        "long_ttft_mean_s": statistics.fmean(ttft_long) if ttft_long else None,
        "long_ttft_max_s": max(ttft_long, default=None),
        "all_itl_p50_s": percentile_or_none(everyone, 50),
        "all_itl_p99_s": percentile_or_none(everyone, 99),
        "all_itl_max_s": max(everyone, default=None),
        "timeline": sorted(timeline),
    }


def transfer(router_url: str) -> dict:
    """One 2,000-token prompt through the split: its KV transfer's bytes and seconds."""
    import httpx

    from quill.bench.client import random_prompt

    body = {"model": "smol", "prompt": random_prompt(LONG_PROMPT, random.Random(99),
            range(1000, 40000)), "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    metrics = httpx.post(f"{router_url}/v1/completions", json=body, timeout=300).json()["metrics"]
    return {"bytes": metrics["kv_transfer_bytes"], "seconds": metrics["kv_transfer_s"]}


def run_side(name: str, items, seed: int, model: str | None) -> tuple[dict, dict | None]:
    """One side's round: its two pinned instances and the router, the workload through it."""
    from quill.bench.client import random_prompt, run_workload
    from quill.router.local import LocalCluster
    from quill.sim.workload import WorkItem

    roles = SIDES[name]
    cluster = LocalCluster(list(roles), ([model] if model else []) + INSTANCE_FLAGS)
    cluster.start()
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "whole": []}
    for role, url in zip(roles, cluster.urls):
        urls[role].append(url)
    try:
        router = RouterThread(urls)
        try:
            rng = random.Random(seed)
            prompts = {i.request_id: random_prompt(i.prompt_tokens, rng, range(1000, 40000))
                       for i in items}  # fmt: skip
            warm = [WorkItem("w", 0.0, 64, 8)]
            asyncio.run(run_workload(router.url, "smol", warm, lambda i: prompts["s0"][:64]))
            records = asyncio.run(
                run_workload(router.url, "smol", items, lambda i: prompts[i.request_id])
            )
            result = measure(records, items)
            moved = transfer(router.url) if name == "split" else None
        finally:
            router.stop()
    finally:
        cluster.stop()
    return result, moved


def one_core_hardware() -> Path:
    """This machine's one-core calibration, measured pinned to one core when missing."""
    from quill.config import cache_dir

    path = cache_dir() / "hardware" / "one-core.json"
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "quill.cli", "cost", "calibrate", "--quick", "--threads", "1",
           "--no-progress", "--out", str(path)]  # fmt: skip
    core = min(os.sched_getaffinity(0))
    subprocess.run(cmd, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {core}))
    return path


def simulate(items, hardware_path: Path, rate: float, model: str | None) -> dict:
    from quill.cost.hardware import HardwareSpec
    from quill.cost.model import ModelSpec, kv_bytes_per_element
    from quill.model.default_model import default_gguf_path
    from quill.sim.cluster import run_colocated, run_disaggregated
    from quill.sim.config import SimConfig

    spec = ModelSpec.resolve(model or str(default_gguf_path()), None)
    spec.kv_bytes_per_element = kv_bytes_per_element("auto")
    hardware = replace(HardwareSpec.load(hardware_path), interconnect_bandwidth=rate)
    # The link is loopback: its copies run on the decode instance's one core, beside its steps.
    config = SimConfig.create(spec, hardware, max_num_batched_tokens=BUDGET,
                              kv_cache_memory=1 << 30, context_len=8192,
                              fetch_shares_cores=True)  # fmt: skip
    runs = {
        "colocated": run_colocated(config, iter(items), 2),
        "split": run_disaggregated(config, iter(items), 1, 1),
    }
    out = {}
    for name, r in runs.items():
        res = r["results"]
        out[name] = {
            "all_itl_p50_s": res["itl_ms"]["p50"] / 1e3,
            "all_itl_p99_s": res["itl_ms"]["p99"] / 1e3,
            "all_itl_max_s": res["itl_ms"]["max"] / 1e3,
            "long_ttft_max_s": res["ttft_ms"]["max"] / 1e3,
        }
    return out


def run(ctx) -> dict:
    ctx.release_engine()  # two server processes need the cores and the memory
    hardware = one_core_hardware()
    quick = ctx.settings.quick
    items = workload(quick)
    rounds: dict[str, list[dict]] = {name: [] for name in SIDES}
    moves = []
    for k in range(1 if quick else 2):
        for name in list(SIDES) if k % 2 == 0 else list(SIDES)[::-1]:
            ctx.log(f"split: round {k + 1}, {name}")
            result, moved = run_side(name, items, ctx.settings.seed + k, ctx.settings.model)
            if result["failed"]:
                failed = f"{result['failed']} requests failed: {result['errors']}"
                raise RuntimeError(f"{name}: {failed}")
            rounds[name].append(result)
            if moved is not None:
                moves.append(moved)
    rate = sum(m["bytes"] for m in moves) / sum(m["seconds"] for m in moves)
    measured = {}
    for name, results in rounds.items():
        keys = [k for k in results[0] if k.endswith("_s")]
        measured[name] = {k: statistics.median(r[k] for r in results) for k in keys}
        measured[name]["timeline"] = results[-1]["timeline"]
    return {
        "workload": [
            [i.request_id, i.arrival_time, i.prompt_tokens, i.output_tokens] for i in items
        ],  # fmt: skip
        "rounds": len(rounds["colocated"]),
        "measured": measured,
        "kv_transfers": moves,
        "kv_transfer_rate": rate,
        "simulated": simulate(items, hardware, rate, ctx.settings.model),
        "hardware_file": str(hardware),
    }


def describe(result: dict) -> Section:
    m, sim = result["measured"], result["simulated"]
    streams = sum(1 for w in result["workload"] if w[0].startswith("s"))
    longs = [w for w in result["workload"] if not w[0].startswith("s")]
    reply = result["workload"][0][3]
    mine = Table(
        ["", "streams' ITL p50", "streams' ITL p99", "longest stall", "long prompts' TTFT mean"],
        [
            [
                LABELS[name],
                seconds(m[name]["streams_itl_p50_s"]),
                seconds(m[name]["streams_itl_p99_s"]),
                seconds(m[name]["streams_longest_stall_s"]),
                seconds(m[name]["long_ttft_mean_s"]),
            ]
            for name in SIDES
        ]
        + [
            [
                "(b) / (a)",
                *(
                    times(m["split"][k] / m["colocated"][k])
                    for k in (
                        "streams_itl_p50_s",
                        "streams_itl_p99_s",
                        "streams_longest_stall_s",
                        "long_ttft_mean_s",
                    )  # fmt: skip
                ),
            ]
        ],
        f"{streams} streams (32-token prompts, {reply}-token replies) start at once; "
        f"{len(longs)} {LONG_PROMPT}-token prompts (16-token replies) arrive at "
        + ", ".join(f"{w[1]:g}" for w in longs)
        + " s. Two instances pinned to one core each behind the router; the streams' gaps from "
        f"the first long prompt's arrival on; medians of {result['rounds']} round(s), the sides "
        "alternating.",
    )

    def pair(name: str, key: str) -> str:
        got, want = m[name][key], sim[name][key]
        return f"{seconds(got)} / {seconds(want)} ({pct(relative_error(want, got))})"

    keys = ("all_itl_p50_s", "all_itl_p99_s", "all_itl_max_s", "long_ttft_max_s")
    against = Table(
        ["measured / simulated", "ITL p50", "ITL p99", "longest gap", "slowest TTFT"],
        [[LABELS[name], *(pair(name, k) for k in keys)] for name in SIDES],
        "Over every request's gaps (the simulator reports no per-stream split). Simulated on "
        "this machine's one-core calibration, the KV cache crossing at the rate measured "
        f"through the split ({megabytes(result['kv_transfer_rate'])}/s, one transfer alone), "
        "fetched beside the decode instance's steps as the engine does, the fetch and the "
        "steps sharing its one core (each at half speed while both run).",
    )
    ratio = m["split"]["streams_itl_p99_s"] / m["colocated"]["streams_itl_p99_s"]
    errors = {
        name: relative_error(sim[name]["all_itl_p99_s"], m[name]["all_itl_p99_s"]) for name in SIDES
    }
    moved = result["kv_transfers"][-1]
    within = [name for name, e in errors.items() if e is not None and abs(e) <= 0.25]
    reading = (
        f"With the phases apart the streams' p99 gap was {seconds(m['split']['streams_itl_p99_s'])}"
        f" against {seconds(m['colocated']['streams_itl_p99_s'])} colocated: {times(ratio)}"
        f" ({'at most' if ratio <= 0.5 else 'more than'} half). Colocated, the p99 is a "
        f"{BUDGET}-token chunk's step, which every stream on that instance waits through; on "
        "the split the decode instance never computes a prompt, and it fetches a long "
        f"prompt's KV ({megabytes(moved['bytes'])} in {seconds(moved['seconds'])}) beside its "
        "steps, which slow while the fetch's copies share their core. What it costs: one "
        f"core writes every reply (median gap {seconds(m['split']['streams_itl_p50_s'])} "
        f"against {seconds(m['colocated']['streams_itl_p50_s'])} with half the streams a "
        "core), and one core takes every prompt in, so the long prompts wait for each other "
        f"(TTFT {times(m['split']['long_ttft_mean_s'] / m['colocated']['long_ttft_mean_s'])}). "
        "The simulator's ITL p99 is "
        + " and ".join(f"{pct(errors[n])} off for {n}" for n in SIDES)
        + {
            2: " (both within 25%)",
            1: f" (within 25% for {within[0]})",
            0: " (neither within 25%)",
        }[len(within)]
        + ". Where they part most: the longest gap on the split, "
        f"{seconds(m['split']['all_itl_max_s'])} against {seconds(sim['split']['all_itl_max_s'])}"
        " simulated, a long prompt's own gap between its first token (the prefill "
        "instance's) and its second: the router's hand-over, the decode instance taking the "
        "request in beside the streams on its one core, and the fetch; the simulator models "
        "only the fetch. The calibration prices the model's step alone, while each instance's "
        "one core also runs its HTTP server and streams every token."
    )
    what = (
        "Experiment 4's second repair, measured: the same two cores as two colocated instances "
        "or as a prefill and a decode instance (`quill serve --disaggregate 1:1`), long prompts "
        "arriving among decoding streams; beside the simulator's answer for both."
    )
    caption = (
        "The streams' inter-token gaps against time since the first long prompt arrived, "
        "colocated (each chunk of a long prompt stalls the streams of its instance) and split "
        "(the decode instance's steps slow while a long prompt's KV comes in)."
    )
    return Section(NAME, TITLE, what, [mine, against], f"{NAME}.png", caption, reading)
