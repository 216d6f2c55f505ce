"""The agents' APIs against chat completions: what `/v1/responses` and `/v1/messages` cost.

Why: both APIs translate into the chat request every API becomes and read the reply with the
same reader, then write their own typed events (several per output item, larger than chat's
chunks). Target (issue 46): at 16 streams, output tokens/s through each at least 0.95x
`/v1/chat/completions` on the same prompts, and the first-token time unchanged within noise.

One `quill serve` (its defaults) per model; N clients in a closed loop, each streaming its
requests one after another over one keep-alive connection (the light client of
benchmarks/bench_server.py: every event holding a text delta timestamped, only events with
usage parsed); the same text prompts (random words, new each request so no prefix cache
helps) through each API, greedy, ignore_eos, a fixed length. Each round runs the three APIs in
turn, the order rotating round by round; each keeps its best round by tokens/s (and the
median round, the steadier figure where rounds spread), and its TTFT and ITL medians over all
rounds. Usage:

    .venv/bin/python benchmarks/bench_agent_apis.py [--models default,llama-3.2-1b-q4_k_m]
        [--clients 16] [--requests-per-client 2] [--prompt-words 96] [--output-len 64]
        [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_server import _Connection, start_server  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402

CACHE = Path(os.environ.get("QUILL_CACHE", Path.home() / ".cache" / "quill"))
MODELS = {
    "default": [],  # quill serve's default model
    "llama-3.2-1b-q4_k_m": [str(CACHE / "peers/models/real/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf")],
}
WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city"
).split()

# Each API: its path, the body of one streamed request, the mark of an event holding text,
# and the output tokens its last usage says.
APIS = {
    # (not the role's chunk, which chat sends before any token)
    "chat": (b"/v1/chat/completions", b'"delta":{"content":"',
             lambda u: u["usage"]["completion_tokens"]),
    "responses": (b"/v1/responses", b'"response.output_text.delta"',
                  lambda u: u["response"]["usage"]["output_tokens"]),
    "messages": (b"/v1/messages", b'"text_delta"', lambda u: u["usage"]["output_tokens"]),
}  # fmt: skip


def body(api: str, text: str, output_len: int) -> dict:
    asked = [{"role": "user", "content": text}]
    common = {"temperature": 0, "ignore_eos": True, "stream": True}
    if api == "chat":
        return {"messages": asked, "max_tokens": output_len,
                "stream_options": {"include_usage": True}, **common}  # fmt: skip
    if api == "responses":
        return {"input": asked, "max_output_tokens": output_len, **common}
    return {"messages": asked, "max_tokens": output_len, **common}


async def run_clients(url: str, api: str, prompts: list[list[str]], output_len: int) -> dict:
    path, mark, tokens_of = APIS[api]
    ttfts: list[float] = []
    gaps: list[float] = []

    async def client(mine: list[str]) -> int:
        conn = _Connection(url)
        tokens = 0
        try:
            for text in mine:
                sent = time.perf_counter()
                arrivals, last = await conn.stream(body(api, text, output_len), path, mark)
                ttfts.append(arrivals[0] - sent)
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
                tokens += tokens_of(last)
        finally:
            conn.close()
        return tokens

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(m) for m in prompts)))
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
            "ttfts": ttfts, "itls": gaps}  # fmt: skip


def prompts_for(rng: random.Random, clients: int, per_client: int, words: int) -> list[list[str]]:
    return [[" ".join(rng.choices(WORDS, k=words)) for _ in range(per_client)]
            for _ in range(clients)]  # fmt: skip


def measure(model: str, args) -> dict:
    proc, url = start_server("auto", MODELS[model])
    rng = random.Random(args.seed)
    runs: dict[str, list[dict]] = {api: [] for api in APIS}
    try:
        for api in APIS:  # warm-up: each path once, the engine's first steps
            asyncio.run(run_clients(url, api, prompts_for(rng, 4, 1, args.prompt_words), 8))
        for r in range(args.rounds):
            order = list(APIS)[r % 3 :] + list(APIS)[: r % 3]
            for api in order:
                prompts = prompts_for(rng, args.clients, args.requests_per_client,
                                      args.prompt_words)  # fmt: skip
                run = asyncio.run(run_clients(url, api, prompts, args.output_len))
                runs[api].append(run)
                print(f"{model} round {r} {api}: {run['tokens_per_s']:.1f} tok/s, TTFT p50 "
                      f"{1000 * statistics.median(run['ttfts']):.0f} ms", flush=True)  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(60)
    out = {}
    for api, done in runs.items():
        ttfts = [t for run in done for t in run["ttfts"]]
        itls = [t for run in done for t in run["itls"]]
        out[api] = {
            "best_tokens_per_s": max(run["tokens_per_s"] for run in done),
            "median_tokens_per_s": statistics.median(run["tokens_per_s"] for run in done),
            "rounds_tokens_per_s": [run["tokens_per_s"] for run in done],
            "ttft_p50_ms": 1000 * statistics.median(ttfts),
            "ttft_p90_ms": 1000 * statistics.quantiles(ttfts, n=10)[-1],
            "itl_p50_ms": 1000 * statistics.median(itls),
        }
    chat = out["chat"]
    for api in ("responses", "messages"):
        out[api]["tokens_per_s_vs_chat"] = out[api]["best_tokens_per_s"] / chat["best_tokens_per_s"]
        out[api]["median_tokens_per_s_vs_chat"] = (
            out[api]["median_tokens_per_s"] / chat["median_tokens_per_s"]
        )
        out[api]["ttft_p50_vs_chat"] = out[api]["ttft_p50_ms"] / chat["ttft_p50_ms"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="default,llama-3.2-1b-q4_k_m")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--prompt-words", type=int, default=96)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"machine": machine_info(2), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "models": {}}  # fmt: skip
    for model in args.models.split(","):
        if model not in MODELS:
            raise SystemExit(f"unknown model {model!r}: one of {', '.join(MODELS)}")
        missing = [p for p in MODELS[model] if not Path(p).exists()]
        if missing:
            print(f"{model}: {missing[0]} is missing (benchmarks/real_shapes.py makes it); "
                  "left out", file=sys.stderr)  # fmt: skip
            continue
        result["models"][model] = measure(model, args)
        for api in ("responses", "messages"):
            m = result["models"][model][api]
            print(f"{model} {api}: {m['tokens_per_s_vs_chat']:.3f}x chat tokens/s (best "
                  f"rounds; medians {m['median_tokens_per_s_vs_chat']:.3f}x), TTFT p50 "
                  f"{m['ttft_p50_vs_chat']:.3f}x", flush=True)  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
