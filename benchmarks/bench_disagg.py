"""Experiment 4's real split: 16 streams decoding while 2,000-token prompts arrive, on two
instances pinned to one core each, (a) colocated behind the router against (b) one prefill and
one decode instance; beside the simulator's answer for the same workload.

(a) `quill serve --replicas 2`'s layout: two whole-request instances, each taking its prompts
in chunks (a token budget of 256) beside its share of the streams. (b) `--disaggregate 1:1`'s:
the prefill instance takes every prompt (the streams' too) and hands the KV over; the decode
instance writes every reply. Same instance flags on both sides (bf16, not quantized, as the
calibration that prices them), the router in this process, the load client of `quill bench`
(every streamed chunk timestamped). The sides alternate round after round.

Measured: the streams' inter-token gaps from the first long prompt's arrival on (p50, p99,
the longest stall), the long prompts' TTFT, and for the simulator's sake the same over every
request. The simulator runs `run_colocated(.., 2)` and `run_disaggregated(.., 1, 1)` on the
same items with this machine's one-core calibration (`quill cost calibrate --quick --threads
1`, run pinned to one core when the file is missing) and the KV transfer rate measured here.
Usage:

    .venv/bin/python benchmarks/bench_disagg.py [--rounds 2] [--hardware FILE]
        [--json docs/results/bench_disagg_issue20.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import uvicorn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.bench.client import random_prompt, run_workload, token_gaps  # noqa: E402
from quill.router.app import build_router_app  # noqa: E402
from quill.router.instances import DECODE, PREFILL, WHOLE  # noqa: E402
from quill.router.local import LocalCluster  # noqa: E402
from quill.sim.workload import WorkItem  # noqa: E402

BUDGET = 256
FLAGS = ["--quantization", "none", "--max-num-batched-tokens", str(BUDGET),
         "--kv-cache-memory", "1GiB", "--served-model-name", "smol",
         "--log-level", "warning", "--no-access-log"]  # fmt: skip
SIDES = {"colocated": [WHOLE, WHOLE], "split": [PREFILL, DECODE]}


def workload(streams: int, stream_reply: int, long_prompts: int, first_at: float, every: float):
    items = [WorkItem(f"s{i}", 0.0, 32, stream_reply) for i in range(streams)]
    items += [WorkItem(f"new{j}", first_at + j * every, 2000, 16) for j in range(long_prompts)]
    return sorted(items, key=lambda i: i.arrival_time)


class RouterThread:
    def __init__(self, urls: dict[str, list[str]]) -> None:
        self.server = uvicorn.Server(
            uvicorn.Config(build_router_app(urls), host="127.0.0.1", port=0, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def measure(records, items) -> dict:
    records = sorted(records, key=lambda r: r.index)  # as the items were given
    failed = [r for r in records if not r.ok]
    first = min(r.scheduled for r, i in zip(records, items) if i.request_id.startswith("new"))
    streams, everyone, ttft_long = [], [], []
    for record, item in zip(records, items):
        if not record.ok:
            continue
        everyone += token_gaps(record)
        if item.request_id.startswith("s"):  # the streams' gaps since the first long prompt
            times = record.chunk_times
            streams += [b - a for a, b in zip(times, times[1:]) if b > first]
        else:
            ttft_long.append(record.ttft)
    return {
        "failed": len(failed),
        "errors": sorted({r.error for r in failed})[:3],
        "streams_itl_p50_s": _pct(streams, 0.5),
        "streams_itl_p99_s": _pct(streams, 0.99),
        "streams_longest_stall_s": max(streams, default=None),
        "long_ttft_mean_s": statistics.fmean(ttft_long) if ttft_long else None,
        "long_ttft_max_s": max(ttft_long, default=None),
        "all_itl_p50_s": _pct(everyone, 0.5),
        "all_itl_p99_s": _pct(everyone, 0.99),
        "all_itl_max_s": max(everyone, default=None),
    }


def transfer_rate(router_url: str) -> tuple[float, float]:
    """One 2,000-token prompt through the split: (bytes, seconds) of its KV transfer."""
    rng = random.Random(99)
    body = {"model": "smol", "prompt": random_prompt(2000, rng, range(1000, 40000)),
            "max_tokens": 4, "ignore_eos": True}  # fmt: skip
    metrics = httpx.post(f"{router_url}/v1/completions", json=body, timeout=300).json()["metrics"]
    return metrics["kv_transfer_bytes"], metrics["kv_transfer_s"]


def run_side(name: str, items, seed: int, model: str | None) -> tuple[dict, tuple | None]:
    argv = ([model] if model else []) + FLAGS
    cluster = LocalCluster(SIDES[name], argv)
    cluster.start()
    urls = {PREFILL: [], DECODE: [], WHOLE: []}
    for role, url in zip(SIDES[name], cluster.urls):
        urls[role].append(url)
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
        rate = transfer_rate(router.url) if name == "split" else None
    finally:
        router.stop()
        cluster.stop()
    return result, rate


def one_core_hardware(path: Path) -> Path:
    if path.exists():
        return path
    print(f"calibrating one core -> {path} (about a minute)", flush=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "quill.cli", "cost", "calibrate", "--quick", "--threads", "1",
           "--no-progress", "--out", str(path)]  # fmt: skip
    first_core = min(os.sched_getaffinity(0))
    subprocess.run(cmd, check=True, preexec_fn=lambda: os.sched_setaffinity(0, {first_core}))
    return path


def simulate(items, hardware_path: Path, rate: float, model: str | None) -> dict:
    from quill.cost.hardware import HardwareSpec
    from quill.cost.model import ModelSpec, kv_bytes_per_element
    from quill.sim.cluster import run_colocated, run_disaggregated
    from quill.sim.config import SimConfig

    if model is None:
        from quill.model.default_model import default_gguf_path

        model = str(default_gguf_path())
    spec = ModelSpec.resolve(model, None)
    spec.kv_bytes_per_element = kv_bytes_per_element("auto")
    hardware = replace(HardwareSpec.load(hardware_path), interconnect_bandwidth=rate)
    config = SimConfig.create(spec, hardware, max_num_batched_tokens=BUDGET,
                              kv_cache_memory=1 << 30, context_len=8192)  # fmt: skip
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--stream-reply", type=int, default=256)
    parser.add_argument("--long-prompts", type=int, default=3)
    # Late enough that every stream is decoding on the decode instance (its prompt and the
    # hand-over behind it), so the gaps measured are steady decoding and the long prompts' toll.
    parser.add_argument("--first-at", type=float, default=4.0)
    parser.add_argument("--every", type=float, default=3.0)
    parser.add_argument("--hardware", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    items = workload(args.streams, args.stream_reply, args.long_prompts, args.first_at,
                     args.every)  # fmt: skip
    rounds = {name: [] for name in SIDES}
    rates = []
    for k in range(args.rounds):
        order = list(SIDES) if k % 2 == 0 else list(SIDES)[::-1]
        for name in order:
            print(f"round {k + 1}: {name}", flush=True)
            result, rate = run_side(name, items, k, args.model)
            print(json.dumps(result), flush=True)
            rounds[name].append(result)
            if rate is not None:
                rates.append(rate)
    cache = Path(os.environ.get("QUILL_CACHE", Path.home() / ".cache" / "quill"))
    hardware = Path(args.hardware) if args.hardware else one_core_hardware(
        cache / "hardware" / "one-core.json")  # fmt: skip
    rate = sum(b for b, _ in rates) / sum(s for _, s in rates)
    simulated = simulate(items, hardware, rate, args.model)

    def median(name: str, key: str):
        values = [r[key] for r in rounds[name] if r[key] is not None]
        return statistics.median(values) if values else None

    keys = list(rounds["colocated"][0])[2:]
    measured = {name: {key: median(name, key) for key in keys} for name in SIDES}
    p99 = {name: measured[name]["streams_itl_p99_s"] for name in SIDES}
    result = {
        "machine": machine_info(1),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "workload": {
            "streams": args.streams,
            "stream_prompt": 32,
            "stream_reply": args.stream_reply,
            "long_prompts": args.long_prompts,
            "long_prompt": 2000,
            "long_reply": 16,
            "first_at_s": args.first_at,
            "every_s": args.every,
            "token_budget": BUDGET,
        },  # fmt: skip
        "rounds": rounds,
        "measured_median": measured,
        "kv_transfer_rate_bytes_per_s": rate,
        "kv_transfers": [{"bytes": b, "seconds": s} for b, s in rates],
        "simulated": simulated,
        "hardware_file": str(hardware),
        "split_over_colocated_streams_itl_p99": p99["split"] / p99["colocated"],
        "sim_error": {
            name: {
                key: simulated[name][key] / measured[name][key] - 1
                for key in simulated[name]
                if measured[name].get(key)
            }
            for name in SIDES
        },
    }
    print(json.dumps({k: v for k, v in result.items() if k not in ("machine", "rounds")},
                     indent=1))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
