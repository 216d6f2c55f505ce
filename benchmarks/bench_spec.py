"""Speculative decoding benchmark: n-gram prompt lookup on against off, in one run, three ways.

Why: drafts guessed from the prompt (quill/engine/speculative.py) should make a reply that
repeats its input (an edit, a summary quoting its text, a code change) come out faster at one
stream, the greedy reply must stay token for token what it is without them, and at a large
batch of ordinary chat, where drafts cannot pay, the cost model's switch (`by_cost`, on by
default) must keep them from costing throughput (target: on / off >= 0.97 tokens/s).

Parts (`--parts`, default all three):

- offline: the grounded prompts (benchmarks/prompts/spec_grounded.json: edit, rewrite, comment,
  rename, quote or summarise a passage) one at a time through `LLM.chat`, greedy, `--max-tokens`
  (128) each; two LLM instances in this process, one with `speculative_config` and one without.
  Tokens/s is all output tokens over the summed wall time of the requests. Reports the drafts'
  acceptance (accepted / drafted tokens), tokens per verify (1 + accepted / steps that carried
  drafts: vLLM's mean acceptance length), tokens per decode pass (a request's tokens after its
  first over its decode passes, each pass being one token plus the drafts it accepted), and how
  many greedy replies differ between the sides (token ids, reply against reply each round).
- http: the same prompts, the same way, through /v1/chat/completions streaming, against two
  `quill serve` subprocesses (one with `--speculative-config`), alive across rounds; tokens
  from the stream's `usage`, drafts and acceptance from its last chunk's `metrics`, verify steps
  from the server's /metrics counters. Replies are compared as text.
- chat64: `--chat-streams` (64) ordinary chat prompts (benchmarks/prompts/spec_chat.json,
  cycled) in one `LLM.chat` batch, `--chat-max-tokens` (64) each with ignore_eos so every reply
  is as long, sampled at `--chat-temperature` (0.7) with one seed per request (0: greedy).

Each part's sides take turns round after round (the order rotating each round, so that drift on
the machine hits every side alike), and each side keeps its BEST round by tokens/s; the ratios
are of those best rounds (every round is in the JSON). Every side runs the engine's defaults
but for two: a fixed KV pool (`--kv-cache-memory`, so that several engines on one machine do
not each size theirs from what the others left free) and int8 weights at every batch size
(`--quantization`: the default, auto, times float against int8 when each engine starts and
keeps int8 up to a row count that varies from one start to the next, so two sides could run
different kernels, and the greedy replies could differ for that alone). `--always-draft` adds
a side "always" (`by_cost: false`: drafts on every step the proposer finds some) to the
offline and chat64 parts, to show what the switch saves or leaves. `--limit N` takes the first
N prompts of each set (a quick check). Usage:

    .venv/bin/python benchmarks/bench_spec.py [--parts offline,http,chat64] [--rounds 3]
        [--max-tokens 128] [--limit N] [--chat-streams 64] [--chat-max-tokens 64]
        [--chat-temperature 0.7] [--spec-config JSON] [--always-draft]
        [--kv-cache-memory 1GiB] [--quantization int8] [--json out.json]

At the defaults on an idle 2-core machine it should take about ten minutes (an estimate: not
yet run in full), most of it the offline and http parts (12 prompts x 128 tokens x 2 sides x 3
rounds each) and the four engines' start (about 20 s each).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_server import finish_results, start_server  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.engine_args import parse_bytes  # noqa: E402

PROMPTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prompts")
DEFAULT_SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
}
PARTS = ("offline", "http", "chat64")


def load_prompts(name: str, limit: int | None) -> list[dict]:
    with open(os.path.join(PROMPTS_DIR, f"{name}.json")) as f:
        prompts = json.load(f)
    return prompts[:limit] if limit else prompts


def rotated(sides: list[str], r: int) -> list[str]:
    k = r % len(sides)
    return sides[k:] + sides[:k]


def best_of(rounds: list[dict]) -> dict:
    return max(rounds, key=lambda x: x["tokens_per_s"])


def spec_summary(run: dict) -> None:
    """Acceptance, tokens per verify and per decode pass, from a run's counts (in place)."""
    drafted, accepted = run["draft_tokens"], run["accepted_tokens"]
    verifies, passes = run.get("verify_steps"), run.get("decode_passes")
    run["acceptance"] = accepted / drafted if drafted else None
    run["tokens_per_verify"] = 1 + accepted / verifies if verifies else None
    run["tokens_per_decode_pass"] = (passes + accepted) / passes if passes else None


# -- offline ---------------------------------------------------------------------------------
def make_llm(args, spec: dict | None) -> LLM:
    options: dict = {"kv_cache_memory": parse_bytes(args.kv_cache_memory)}
    if args.quantization:
        options["quantization"] = args.quantization
    if spec is not None:
        options["speculative_config"] = spec
    return LLM(**options)


def weights_of(llm: LLM) -> str:
    """How the weights run: int8 up to some rows, or float (auto measures it per engine, so two
    engines can differ; a different path for a 5-row verify than a 1-row decode can change a
    greedy reply)."""
    from quill.model.quant import QuantizedLinear

    for module in llm.engine.runner.model.modules():
        if isinstance(module, QuantizedLinear):
            rows = "any" if module.max_rows is None else module.max_rows
            return f"{module.method} up to {rows} rows"
    return "float"


def engine_spec_totals(llm: LLM) -> tuple[int, int, int]:
    """The engine's running (verify steps, draft tokens, accepted tokens); zeros when off."""
    scheduler = llm.engine.scheduler
    stats = getattr(scheduler, "spec_stats", None)
    if getattr(scheduler, "speculative", None) is None or stats is None:
        return 0, 0, 0
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


def drafts_allowed(llm: LLM) -> int | None:
    step = llm.engine.last_step
    spec = step.spec_decode if step is not None else None
    return None if spec is None else spec.drafts_allowed


def run_offline(llm: LLM, prompts: list[dict], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Each prompt alone, greedy; the run's figures and every reply's token ids."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    verifies0, _, _ = engine_spec_totals(llm)
    replies: list[list[int]] = []
    tokens = drafted = accepted = passes = 0
    wall = 0.0
    for p in prompts:
        start = time.perf_counter()
        out = llm.chat(p["messages"], params, use_tqdm=False)[0]
        wall += time.perf_counter() - start
        ids = list(out.outputs[0].token_ids)
        replies.append(ids)
        tokens += len(ids)
        drafted += out.metrics.num_draft_tokens
        accepted += out.metrics.num_accepted_tokens
        passes += max(0, len(ids) - 1 - out.metrics.num_accepted_tokens)
    verifies1, _, _ = engine_spec_totals(llm)
    run = {
        "requests": len(prompts),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": verifies1 - verifies0,
        "decode_passes": passes,
    }
    spec_summary(run)
    return run, replies


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_replies(base: list, other: list, ids: list[str]) -> list[dict]:
    """The replies of `other` that differ from `base`'s, with where they first differ."""
    diffs = []
    for pid, a, b in zip(ids, base, other):
        at = first_difference(a, b)
        if at is not None:
            diffs.append({"id": pid, "first_difference_at": at})
    return diffs


def part_offline(args, llms: dict[str, LLM], prompts: list[dict]) -> dict:
    ids = [p["id"] for p in prompts]
    sides = list(llms)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    mismatches: dict[str, list[dict]] = {s: [] for s in sides if s != "off"}
    first_off: list | None = None
    for r in range(args.rounds):
        replies: dict[str, list] = {}
        for side in rotated(sides, r):
            run, replies[side] = run_offline(llms[side], prompts, args.max_tokens)
            runs[side].append(run)
            print(f"offline, round {r}, {side}: {_brief(run)}", flush=True)
        for side in mismatches:
            for d in compare_replies(replies["off"], replies[side], ids):
                mismatches[side].append({"round": r, **d})
        if first_off is None:
            first_off = replies["off"]
        else:  # the plain engine against itself: is greedy here deterministic at all?
            for d in compare_replies(first_off, replies["off"], ids):
                mismatches.setdefault("off_vs_off_round0", []).append({"round": r, **d})
    return _part_result(runs, args.rounds * len(prompts), mismatches)


def part_chat64(args, llms: dict[str, LLM], prompts: list[dict]) -> dict:
    n = args.chat_streams
    conversations = [prompts[i % len(prompts)]["messages"] for i in range(n)]
    if args.chat_temperature > 0:
        params = [
            SamplingParams(temperature=args.chat_temperature, seed=1000 + i,
                           max_tokens=args.chat_max_tokens, ignore_eos=True)
            for i in range(n)
        ]  # fmt: skip
    else:
        params = SamplingParams(temperature=0, max_tokens=args.chat_max_tokens, ignore_eos=True)
    sides = list(llms)
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for r in range(args.rounds):
        for side in rotated(sides, r):
            llm = llms[side]
            before = engine_spec_totals(llm)
            start = time.perf_counter()
            outs = llm.chat(conversations, params, use_tqdm=False)
            wall = time.perf_counter() - start
            after = engine_spec_totals(llm)
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            run = {
                "requests": n,
                "tokens": tokens,
                "seconds": wall,
                "tokens_per_s": tokens / wall,
                "verify_steps": after[0] - before[0],
                "draft_tokens": after[1] - before[1],
                "accepted_tokens": after[2] - before[2],
                "drafts_allowed_at_end": drafts_allowed(llm),
            }
            spec_summary(run)
            runs[side].append(run)
            print(f"chat64, round {r}, {side}: {_brief(run)}", flush=True)
    return _part_result(runs, None, {})


# -- http ------------------------------------------------------------------------------------
def scrape_spec(client: httpx.Client, url: str) -> dict[str, float]:
    """The server's speculative decoding counters from /metrics (zeros when it has none)."""
    totals = {"num_drafts": 0.0, "num_draft_tokens": 0.0, "num_accepted_tokens": 0.0}
    text = client.get(f"{url}/metrics").text
    for line in text.splitlines():
        if not line.startswith("quill:spec_decode_num_"):
            continue
        name, _, value = line.rpartition(" ")
        key = name.split("{")[0].removeprefix("quill:spec_decode_").removesuffix("_total")
        if key in totals:
            totals[key] += float(value)
    return totals


def stream_chat(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> dict:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    text, chunks, last = [], 0, None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"server answered {response.status_code}: {response.text}")
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                last = event
            for choice in event.get("choices", ()):
                content = choice.get("delta", {}).get("content")
                if content:
                    text.append(content)
                    chunks += 1
    if last is None:
        raise RuntimeError("the stream ended without its usage chunk")
    return {"text": "".join(text), "chunks": chunks, "usage": last["usage"],
            "metrics": last.get("metrics") or {}}  # fmt: skip


def run_http(client: httpx.Client, url: str, prompts: list[dict], max_tokens: int):
    before = scrape_spec(client, url)
    texts: list[str] = []
    tokens = chunks = drafted = accepted = passes = 0
    wall = 0.0
    for p in prompts:
        start = time.perf_counter()
        reply = stream_chat(client, url, p["messages"], max_tokens)
        wall += time.perf_counter() - start
        texts.append(reply["text"])
        n = reply["usage"]["completion_tokens"]
        tokens += n
        chunks += reply["chunks"]
        a = reply["metrics"].get("num_accepted_tokens", 0)
        drafted += reply["metrics"].get("num_draft_tokens", 0)
        accepted += a
        passes += max(0, n - 1 - a)
    after = scrape_spec(client, url)
    run = {
        "requests": len(prompts),
        "tokens": tokens,
        "content_chunks": chunks,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "draft_tokens": drafted,
        "accepted_tokens": accepted,
        "verify_steps": int(after["num_drafts"] - before["num_drafts"]),
        "decode_passes": passes,
    }
    spec_summary(run)
    return run, texts


def part_http(args, spec: dict, prompts: list[dict]) -> dict:
    common = ["--kv-cache-memory", args.kv_cache_memory]
    if args.quantization:
        common += ["--quantization", args.quantization]
    print("starting two servers ...", flush=True)
    servers = {
        "off": start_server(args.api_core, common),
        "on": start_server(args.api_core, [*common, "--speculative-config", json.dumps(spec)]),
    }
    ids = [p["id"] for p in prompts]
    runs: dict[str, list[dict]] = {s: [] for s in servers}
    mismatches: dict[str, list[dict]] = {"on": []}
    try:
        with httpx.Client(timeout=600) as client:
            for _, url in servers.values():  # warm up: the first passes allocate and pick paths
                stream_chat(client, url, prompts[0]["messages"], args.max_tokens)
            for r in range(args.rounds):
                texts = {}
                for side in rotated(list(servers), r):
                    url = servers[side][1]
                    run, texts[side] = run_http(client, url, prompts, args.max_tokens)
                    runs[side].append(run)
                    print(f"http, round {r}, {side}: {_brief(run)}", flush=True)
                for pid, a, b in zip(ids, texts["off"], texts["on"]):
                    if a != b:
                        at = first_difference(list(a), list(b))
                        mismatches["on"].append({"round": r, "id": pid, "first_char_at": at})
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    return _part_result(runs, args.rounds * len(prompts), mismatches)


# -- report ----------------------------------------------------------------------------------
def _brief(run: dict) -> str:
    out = f"{run['tokens']} tokens in {run['seconds']:.2f} s, {run['tokens_per_s']:.1f} tok/s"
    if run.get("draft_tokens"):
        out += (
            f", {run['accepted_tokens']}/{run['draft_tokens']} drafts accepted, "
            f"{run['verify_steps']} verify steps"
        )
    return out


def _part_result(runs: dict[str, list[dict]], replies: int | None, mismatches: dict) -> dict:
    best = {side: best_of(rs) for side, rs in runs.items()}
    off = best["off"]["tokens_per_s"]
    ratios = {side: b["tokens_per_s"] / off for side, b in best.items() if side != "off"}
    medians = {side: statistics.median(r["tokens_per_s"] for r in rs) for side, rs in runs.items()}
    result = {"best": best, "ratio_to_off": ratios, "median_tokens_per_s": medians, "rounds": runs}
    if replies is not None:
        result["replies_compared"] = replies
        result["mismatches"] = mismatches
    return result


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def print_report(results: dict, args) -> None:
    print(f"best of {args.rounds} alternating rounds per side; ratios are of the best rounds\n")
    print("| part | side | tok/s (best) | tok/s (median) | on / off | acceptance | "
          "tokens / verify | tokens / decode pass | replies differing from off |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for part in PARTS:
        if part not in results["parts"]:
            continue
        res = results["parts"][part]
        for side, b in res["best"].items():
            ratio = res["ratio_to_off"].get(side)
            if "mismatches" in res and side != "off":
                diff = f"{len(res['mismatches'].get(side, []))} of {res['replies_compared']}"
            else:
                diff = "-"
            print(
                f"| {part} | {side} | {b['tokens_per_s']:.1f} | "
                f"{res['median_tokens_per_s'][side]:.1f} | {_fmt(ratio, '.3f')} | "
                f"{_fmt(b.get('acceptance'), '.3f')} | {_fmt(b.get('tokens_per_verify'))} | "
                f"{_fmt(b.get('tokens_per_decode_pass'))} | {diff} |"
            )
    offline = results["parts"].get("offline")
    if offline and offline["mismatches"].get("off_vs_off_round0"):
        n = len(offline["mismatches"]["off_vs_off_round0"])
        print(f"\nnote: the plain engine's greedy replies changed between rounds ({n} replies)")
    chat = results["parts"].get("chat64")
    if chat and "on" in chat["ratio_to_off"]:
        ratio = chat["ratio_to_off"]["on"]
        verdict = "meets" if ratio >= 0.97 else "MISSES"
        print(f"\nchat64: on / off = {ratio:.3f} ({verdict} the 0.97 target)")
    if results.get("weights"):
        print("weights: " + ", ".join(f"{s}: {w}" for s, w in results["weights"].items()))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--parts", default=",".join(PARTS), help="of offline,http,chat64")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128, help="offline and http replies")
    parser.add_argument("--limit", type=int, default=None, help="first N prompts of each set")
    parser.add_argument("--chat-streams", type=int, default=64)
    parser.add_argument("--chat-max-tokens", type=int, default=64)
    parser.add_argument("--chat-temperature", type=float, default=0.7, help="0: greedy")
    parser.add_argument(
        "--spec-config", default=json.dumps(DEFAULT_SPEC), help="the 'on' side's config (JSON)"
    )
    parser.add_argument(
        "--always-draft",
        action="store_true",
        help='also a side with "by_cost": false (offline and chat64 parts)',
    )
    parser.add_argument("--kv-cache-memory", default="1GiB", help="every side's KV pool")
    parser.add_argument(
        "--quantization",
        default="int8",
        help="every side's weights (default int8; '' or auto: the engine's default, auto, "
        "which measures per engine and can give the sides different paths)",
    )
    parser.add_argument("--api-core", default="auto", help="quill serve --api-core (http part)")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        parser.error(f"unknown part(s) {', '.join(sorted(unknown))}; choose of {PARTS}")
    spec = json.loads(args.spec_config)
    grounded = load_prompts("spec_grounded", args.limit)
    chat = load_prompts("spec_chat", args.limit)

    results: dict = {"spec_config": spec, "parts": {}}
    llms: dict[str, LLM] = {}
    started = time.perf_counter()
    if "offline" in parts or "chat64" in parts:
        print("loading the engines ...", flush=True)
        llms = {"off": make_llm(args, None), "on": make_llm(args, spec)}
        if args.always_draft:
            llms["always"] = make_llm(args, {**spec, "by_cost": False})
        results["weights"] = {side: weights_of(llm) for side, llm in llms.items()}
        if len(set(results["weights"].values())) > 1:
            print(f"warning: the sides' weights differ: {results['weights']}", flush=True)
        warm = SamplingParams(temperature=0, max_tokens=args.max_tokens)
        for llm in llms.values():  # the first passes allocate and settle the kernels' paths
            llm.chat(grounded[0]["messages"], warm, use_tqdm=False)
    for part in parts:
        if part == "offline":
            results["parts"]["offline"] = part_offline(args, llms, grounded)
        elif part == "http":
            results["parts"]["http"] = part_http(args, spec, grounded)
        elif part == "chat64":
            results["parts"]["chat64"] = part_chat64(args, llms, chat)
    results["total_seconds"] = time.perf_counter() - started
    finish_results(results, args)
    print_report(results, args)
    print(f"\ntotal {results['total_seconds']:.0f} s")


if __name__ == "__main__":
    main()
