"""Embedding requests beside generating streams: what they cost the streams' token gaps.

Why: a RAG application indexes documents on the server that answers its users. Target (issue
47): embedding requests beside 16 generating streams cost those streams no more than a prompt
chunk of the same tokens would: the streams' inter-token latency p99 within 1.2x of the same
load with equal-length prompts (completions of one token) instead.

One `quill serve` of the model; each round runs 16 streams (random prompts of 32 tokens, a
fixed reply length, greedy, ignore_eos) and, beside them from 0.5 s until they end, one side
request every `--side-interval` seconds (open loop) of `--side-tokens` random token ids: either
`/v1/embeddings` or `/v1/completions` with `max_tokens` 1. The two sides alternate round by
round on the same server; each side's gaps are pooled over its rounds. Random ids: no prefix
cache serves any prompt.

    .venv/bin/python benchmarks/bench_embeddings_beside_generation.py \\
        [--model PATH] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_server import start_server  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.bench.client import random_prompt, run_workload, token_gaps  # noqa: E402
from quill.sim.metrics import Distribution  # noqa: E402
from quill.sim.workload import WorkItem  # noqa: E402

VOCAB = range(1000, 30000)


async def one_round(url: str, model: str, side: str, args, seed: int) -> tuple[list, list]:
    """The streams' token gaps and the side requests' latencies of one round."""
    rng = random.Random(seed)
    items = [WorkItem(f"s{i}", 0.0, 32, args.output_tokens) for i in range(args.streams)]
    streams = asyncio.ensure_future(
        run_workload(url, model, items, lambda _: random_prompt(32, rng, VOCAB))
    )
    latencies: list[float] = []

    async def send(http: httpx.AsyncClient, ids: list[int]) -> None:
        start = time.perf_counter()
        if side == "embeddings":
            r = await http.post("/v1/embeddings", json={"model": model, "input": ids})
        else:
            r = await http.post("/v1/completions", json={"model": model, "prompt": ids,
                                                          "max_tokens": 1})  # fmt: skip
        r.raise_for_status()
        latencies.append(time.perf_counter() - start)

    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        await asyncio.sleep(0.5)
        sent = []
        while not streams.done():
            sent.append(asyncio.ensure_future(send(http, random_prompt(args.side_tokens, rng,
                                                                        VOCAB))))  # fmt: skip
            await asyncio.sleep(args.side_interval)
        records = await streams
        await asyncio.gather(*sent)
    failed = [r.error for r in records if not r.ok]
    if failed:
        raise SystemExit(f"streams failed: {failed[:3]}")
    return [g for r in records for g in token_gaps(r)], latencies


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a model path (default: quill's)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--output-tokens", type=int, default=96)
    parser.add_argument("--side-tokens", type=int, default=256)
    parser.add_argument("--side-interval", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--serve-args", default="", help="more `quill serve` options")
    args = parser.parse_args()
    extra = ([args.model] if args.model else []) + args.serve_args.split()
    proc, url = start_server("auto", extra)
    try:
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        asyncio.run(one_round(url, model, "embeddings", args, seed=10_000))  # warm-up
        gaps = {"embeddings": Distribution(), "prompts": Distribution()}
        side_ms = {"embeddings": Distribution(), "prompts": Distribution()}
        for r in range(args.rounds):
            order = ["embeddings", "prompts"] if r % 2 == 0 else ["prompts", "embeddings"]
            for side in order:
                seed = 2 * r + (side == "prompts")  # never a prompt the cache holds
                got, latencies = asyncio.run(one_round(url, model, side, args, seed))
                for g in got:
                    gaps[side].add(g)
                for t in latencies:
                    side_ms[side].add(t)
                itl = Distribution()
                for g in got:
                    itl.add(g)
                s = itl.summary(1000)
                print(f"round {r} {side}: ITL p50 {s['p50']:.1f} ms, p99 {s['p99']:.1f} ms, "
                      f"{len(latencies)} side requests", flush=True)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    summary = {"machine": machine_info(os.cpu_count() or 1), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "settings": vars(args),
               "itl_ms": {k: v.summary(1000) for k, v in gaps.items()},
               "side_latency_ms": {k: v.summary(1000) for k, v in side_ms.items()}}  # fmt: skip
    emb, pro = summary["itl_ms"]["embeddings"], summary["itl_ms"]["prompts"]
    for q in ("p50", "p90", "p99"):
        summary[f"itl_{q}_ratio"] = emb[q] / pro[q]
        print(f"ITL {q}: embeddings beside {emb[q]:.1f} ms, prompts beside {pro[q]:.1f} ms: "
              f"{emb[q] / pro[q]:.3f}x")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
