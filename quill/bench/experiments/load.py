"""Experiment 5, load: TTFT and inter-token latency at p50 and p99 against the request rate,
up to and past saturation, for the real server and for the simulator on the same workload.

On a small machine the engine shares its cores with the HTTP side and the client, and its
steps run slower than they did alone when the machine was calibrated. So the simulator is run
twice: with the calibration as it is, and refitted on steps the server itself recorded while
serving other requests first (`quill cost calibrate --from-steps`): what a step costs under
load, learned from requests that are not the ones predicted.
"""

from __future__ import annotations

import asyncio
import random
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

from quill.bench.experiments.report import Section, Table, num, pct, seconds
from quill.bench.experiments.server import SERVED_NAME, ServerProcess
from quill.bench.experiments.stats import relative_error

NAME = "load"
TITLE = "Load: latency against the request rate, the server and the simulator"
MAX_NUM_SEQS = 32
BUDGET = 512
KV_CACHE_MEMORY = 256 << 20
SATURATION_BURST = 8 * MAX_NUM_SEQS


@dataclass
class Plan:
    requests: int
    prompt: int
    reply: int
    fractions: tuple[float, ...]  # rates, as fractions of the simulated saturation
    calibration_requests: int
    poisson_calibration: bool  # also a Poisson stream (small batches) in the serving fit


def plan(settings) -> Plan:
    if settings.quick:
        return Plan(10, 128, 32, (0.5, 1.2), 8, False)
    return Plan(40, 128, 32, (0.3, 0.6, 0.9, 1.2), 24, True)


def needs(ctx):
    return None  # the server loads its own engine


def _workload(p: Plan, n: int, rate: float, seed: int):
    from quill.sim.workload import LengthSpec, synthetic

    lengths = LengthSpec(p.prompt, p.prompt), LengthSpec(p.reply, p.reply)
    return list(synthetic(n, rate, *lengths, seed=seed))


def _send(url: str, items, rng: random.Random):
    from quill.bench.client import random_prompt, run_workload

    def make_prompt(item) -> list[int]:
        return random_prompt(item.prompt_tokens, rng, range(100, 40000))

    return asyncio.run(run_workload(url, SERVED_NAME, items, make_prompt))


def _figures(summary: dict) -> dict:
    return {
        "ttft_p50_s": summary["ttft_ms"]["p50"] and summary["ttft_ms"]["p50"] / 1e3,
        "ttft_p99_s": summary["ttft_ms"]["p99"] and summary["ttft_ms"]["p99"] / 1e3,
        "itl_p50_s": summary["itl_ms"]["p50"] and summary["itl_ms"]["p50"] / 1e3,
        "itl_p99_s": summary["itl_ms"]["p99"] and summary["itl_ms"]["p99"] / 1e3,
        "output_tokens_per_s": summary["output_throughput"],
        "requests_per_s": summary["request_throughput"],
    }


def _serving_fit(ctx, steps_file: Path, skip: int):
    from quill.cost.refit import recorded_steps, refit_spec

    steps = recorded_steps(steps_file, skip)
    return refit_spec(ctx.hardware, ctx.model, steps), len(steps)


def run(ctx) -> dict:
    from quill.bench.client import summarize
    from quill.cost.step import CostModel
    from quill.sim.cluster import run_colocated
    from quill.sim.config import SimConfig

    settings, p = ctx.settings, plan(ctx.settings)
    ctx.release_engine()  # the server loads its own copy of the model
    config = SimConfig.create(
        ctx.model,
        ctx.hardware,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory=KV_CACHE_MEMORY,
        context_len=8192,
    )

    def saturation(cfg) -> float:
        # A burst several times the batch limit, so the figure is the steady rate of full
        # batches and not the ramp of one small batch (the simulator runs it in a moment).
        burst = _workload(p, SATURATION_BURST, float("inf"), settings.seed)
        return run_colocated(cfg, burst)["results"]["request_throughput"]

    steps_file = Path(tempfile.mkdtemp(prefix="quill-experiments-")) / "steps.jsonl"
    flags = ["--dtype", "float32", "--quantization", "none"]
    flags += ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", str(BUDGET)]
    flags += ["--kv-cache-memory", str(KV_CACHE_MEMORY), "--record-steps", str(steps_file)]
    if ctx.calibration.get("path"):
        flags += ["--hardware", ctx.calibration["path"]]
    if settings.model:
        flags.insert(0, settings.model)
    rng = random.Random(settings.seed)
    runs = []
    ctx.log("load: starting `quill serve`")
    with ServerProcess(flags) as server:
        _send(server.url, _workload(p, 4, float("inf"), settings.seed + 1), rng)  # warm-up
        skip = len(steps_file.read_text().splitlines())
        loads = [(float("inf"), settings.seed + 101)]
        if p.poisson_calibration:
            loads.insert(0, (0.6 * saturation(config), settings.seed + 100))
        for rate, seed in loads:
            ctx.log(f"load: serving calibration, {p.calibration_requests} requests at {rate:.3g}/s")
            _send(server.url, _workload(p, p.calibration_requests, rate, seed), rng)
        fitted, fitted_steps = _serving_fit(ctx, steps_file, skip)
        serving = replace(config, cost=CostModel(ctx.model, fitted))
        top = saturation(serving)
        for fraction in p.fractions:
            rate = top * fraction
            ctx.log(f"load: {p.requests} requests at {rate:.3g}/s ({fraction:g} x saturation)")
            items = _workload(p, p.requests, rate, settings.seed)
            real = summarize(_send(server.url, items, rng))
            runs.append(
                {
                    "rate": rate,
                    "fraction": fraction,
                    "failed": real["num_failed"],
                    "server": _figures(real),
                    "simulated": _figures(run_colocated(serving, items)["results"]),
                    "simulated_calibration": _figures(run_colocated(config, items)["results"]),
                }
            )
    return {
        "plan": vars(p) | {"fractions": list(p.fractions)},
        "saturation_rate": top,
        "saturation_rate_calibration": saturation(config),
        "serving_fit_steps": fitted_steps,
        "serving_fit_error": (fitted.calibration or {}).get("fit_error", {}).get("all"),
        "server_flags": flags,
        "runs": runs,
    }


def describe(result: dict) -> Section:
    p, runs = result["plan"], result["runs"]

    def cell(run: dict, key: str) -> str:
        real, sim = run["server"][key], run["simulated"][key]
        return f"{seconds(real)} / {seconds(sim)} ({pct(relative_error(sim, real))})"

    table = Table(
        [
            "rate (req/s)",
            "x saturation",
            "TTFT p50: server / simulated",
            "TTFT p99",
            "ITL p50",
            "ITL p99",
            "output tok/s",
        ],
        [
            [
                num(r["rate"]),
                f"{r['fraction']:g}",
                cell(r, "ttft_p50_s"),
                cell(r, "ttft_p99_s"),
                cell(r, "itl_p50_s"),
                cell(r, "itl_p99_s"),
                f"{num(r['server']['output_tokens_per_s'])} / "
                f"{num(r['simulated']['output_tokens_per_s'])}",
            ]
            for r in runs
        ],
        f"{p['requests']} requests per rate, Poisson arrivals, {p['prompt']}-token prompts and "
        f"{p['reply']}-token replies; `quill serve` with max-num-seqs {MAX_NUM_SEQS}, a "
        f"{BUDGET}-token budget and a {KV_CACHE_MEMORY >> 20} MiB KV pool, streamed with one "
        "chunk per token. Simulated: the same workload, steps priced by the calibration refitted "
        f"on {result['serving_fit_steps']} steps the server recorded while serving other "
        "requests first; saturation is that simulator's throughput on a burst of "
        f"{SATURATION_BURST} requests.",
    )
    raw = Table(
        ["rate (req/s)", "TTFT p50: simulated with the calibration as it is", "ITL p50", "ITL p99"],
        [
            [
                num(r["rate"]),
                _vs(r, "ttft_p50_s"),
                _vs(r, "itl_p50_s"),
                _vs(r, "itl_p99_s"),
            ]
            for r in runs
        ],
        "Error against the server, for the simulator run with the machine's calibration "
        "unchanged (measured with nothing else running, no HTTP side or client).",
    )
    errors = [
        abs(relative_error(r["simulated"][k], r["server"][k]))
        for r in runs
        for k in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s")
        if relative_error(r["simulated"][k], r["server"][k]) is not None
    ]
    raw_itl = [
        relative_error(r["simulated_calibration"]["itl_p50_s"], r["server"]["itl_p50_s"])
        for r in runs
    ]
    first, last = runs[0], runs[-1]
    caption = (
        "TTFT and inter-token latency (p50, p99) against the request rate: the server (dots) "
        "and the simulator (lines; dashed: with the calibration unrefitted). TTFT p50 rose "
        f"from {seconds(first['server']['ttft_p50_s'])} at {num(first['rate'])} req/s to "
        f"{seconds(last['server']['ttft_p50_s'])} at {num(last['rate'])} req/s."
    )
    reading = (
        f"The simulator saturates one replica at {num(result['saturation_rate'])} requests per "
        f"second with the serving fit ({num(result['saturation_rate_calibration'])} with the "
        f"calibration as it is). From {num(first['rate'])} to {num(last['rate'])} req/s "
        f"({first['fraction']:g} to {last['fraction']:g} of that) the server's TTFT p50 went "
        f"from {seconds(first['server']['ttft_p50_s'])} to {seconds(last['server']['ttft_p50_s'])}"
        f" and its ITL p99 from {seconds(first['server']['itl_p99_s'])} to "
        f"{seconds(last['server']['itl_p99_s'])}. Over the {len(errors)} latency figures the "
        f"simulator's error was at most {pct(max(errors), False) if errors else '-'} (median "
        f"{pct(sorted(errors)[len(errors) // 2], False) if errors else '-'}); with the "
        "calibration as it is, its median ITL was off by "
        + ", ".join(pct(e) for e in raw_itl)
        + " at these rates."
        + (
            " Past saturation a queue grows in both for as long as requests keep coming, so "
            "any error in the service rate is multiplied there."
            if last["fraction"] > 1
            else ""
        )
    )
    what = (
        "TTFT and inter-token latency at p50 and p99 against the request rate, the real server "
        "and the simulator on the same workload, from well below to past saturation."
    )
    return Section(NAME, TITLE, what, [table, raw], f"{NAME}.png", caption, reading)


def _vs(run: dict, key: str) -> str:
    real, sim = run["server"][key], run["simulated_calibration"][key]
    return f"{seconds(sim)} ({pct(relative_error(sim, real))})"
