"""Server benchmark: aggregate output tokens/s of `quill serve` under N concurrent streaming
clients, against the offline engine kept at the same concurrency, in one run.

Both sides run the same requests (random prompt token ids, greedy, ignore_eos, fixed length):
the offline engine keeps N requests in flight and steps; the server runs as a real subprocess
and N asyncio clients each stream their requests one after another over HTTP. The ratio is the
share of the engine's throughput that survives the HTTP layer (target: at least 85%). Usage:

    .venv/bin/python benchmarks/bench_server.py [--clients 16] [--requests-per-client 2]
        [--max-tokens 64] [--prompt-tokens 32] [--rounds 2] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import httpx
import torch

from quill import LLM, SamplingParams


def prompt_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def run_offline(llm: LLM, args, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    pending = list(prompts)
    in_flight, tokens = 0, 0
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < args.clients:  # same concurrency as the server's clients
            engine.add_request(pending.pop(0), params)
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "quill.cli", "serve", "--port", "0", "--dtype", args.dtype,
        "--kv-cache-memory", str(args.kv_cache_memory), "--no-access-log",
        "--log-level", "warning",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "QUILL_API_KEY"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    url = None
    for line in proc.stdout:
        if m := re.search(r"(http://[\w.]+:\d+) ", line):
            url = m.group(1)
        if "ready" in line:
            break
    if url is None:
        proc.kill()
        raise SystemExit("the server did not start")
    # Keep reading its output, or a full pipe would one day block the server.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, url


async def run_clients(args, url: str, prompts: list[list[int]], max_tokens: int) -> dict:
    per_client = [prompts[i :: args.clients] for i in range(args.clients)]
    timings: list[dict] = []

    async def one(client: httpx.AsyncClient, prompt: list[int]) -> int:
        body = {
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with client.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            async for line in r.aiter_lines():
                if '"usage"' in line:  # only the last chunk is parsed: the client stays light
                    last = json.loads(line[len("data: ") :])
        timings.append(last["metrics"])
        return last["usage"]["completion_tokens"]

    async def client_loop(client, mine) -> int:
        return sum([await one(client, p) for p in mine])

    limits = httpx.Limits(max_connections=args.clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        start = time.perf_counter()
        counts = await asyncio.gather(*(client_loop(client, m) for m in per_client))
        wall = time.perf_counter() - start
    tokens = sum(counts)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "median_ttft_s": statistics.median(t["time_to_first_token"] for t in timings),
        "median_itl_s": statistics.median(t["mean_inter_token_latency"] for t in timings),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-memory", type=int, default=512 << 20)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    n = args.clients * args.requests_per_client
    prompts = [prompt_ids(args.prompt_tokens, i) for i in range(n)]
    warm = prompts[: args.clients]

    llm = LLM(dtype=args.dtype, kv_cache_memory=args.kv_cache_memory)
    proc, url = start_server(args)
    offline_runs, server_runs = [], []
    try:
        # Warm-up at full concurrency (first calls allocate and pick kernels), then rounds that
        # alternate the two, so that a noisy neighbour on the machine hits both alike.
        run_offline(llm, args, warm, 4)
        asyncio.run(run_clients(args, url, warm, 4))
        for r in range(args.rounds):
            offline_runs.append(run_offline(llm, args, prompts, args.max_tokens))
            print(f"round {r}: offline engine {offline_runs[-1]}", flush=True)
            server_runs.append(asyncio.run(run_clients(args, url, prompts, args.max_tokens)))
            print(f"round {r}: server {server_runs[-1]}", flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    offline = max(offline_runs, key=lambda x: x["tokens_per_s"])  # best of the rounds, each
    server = max(server_runs, key=lambda x: x["tokens_per_s"])
    ratio = server["tokens_per_s"] / offline["tokens_per_s"]
    results = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} {os.cpu_count()} cpus, "
        f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": vars(args),
        "offline": offline,
        "server": server,
        "rounds": {"offline": offline_runs, "server": server_runs},
        "server_over_offline": ratio,
    }
    print(f"\n{results['machine']}, {args.dtype}, {results['date']}")
    print(f"`{results['command']}`\n")
    print(f"best of {args.rounds} alternating rounds\n")
    print("| | output tok/s | tokens | seconds |")
    print("|---|---|---|---|")
    for name in ("offline", "server"):
        r = results[name]
        print(f"| {name} | {r['tokens_per_s']:.1f} | {r['tokens']} | {r['seconds']:.2f} |")
    print(
        f"\nserver / offline: {100 * ratio:.1f}% (target >= 85%); server median TTFT "
        f"{server['median_ttft_s']:.3f} s, median mean-ITL {server['median_itl_s'] * 1000:.1f} ms"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
