"""HTTP benchmark: `quill serve` with its defaults against llama-server and vLLM, N clients.

Why: people meet quill over HTTP, and llama-server is what they would run instead. The target:
out of the box, quill serve's output tokens/s is at least llama-server's (`-np 64 -cb -fa on`,
its best settings) at 1, 4, 16 and 64 streaming clients, on the GGUF of the same precision (f32;
bf16 where the CPU has avx512_bf16 or AMX) and on the default model's own Q4_1 GGUF, with a
median inter-token latency no higher and its time to first token still the lower. The third
side is vLLM's CPU backend: `vllm serve` of the same model (quill's converted Hugging Face
directory, bf16, --max-model-len 4096, 4 GiB of KV cache; benchmarks/peers/vllm_cpu.py), with
its own defaults otherwise (threads, batching), measured and compared in the same way.

Workload: N clients in a closed loop, each streaming --requests-per-client requests one after
the other: ~256-token text prompts (random words of the default model's vocabulary; every
server gets the same text and tokenizes it itself; every prompt is new, so no prefix cache
helps), 64 new tokens, greedy, ignore_eos. One server runs at a time, started afresh for each
run; at each concurrency level the sides take turns round after round, each keeping its best
run by output tokens/s. Each token is timestamped on arrival: quill's chunks carry one logprob
per token (as quill.bench.client asks), llama-server's its running count of tokens
(timings_per_token), vLLM's its running usage.completion_tokens (stream_options
continuous_usage_stats). --peers picks the other sides; one not built or installed
(benchmarks/peers/build_llama_cpp.sh, install_vllm_cpu.sh) is left out with a note. Usage:

    .venv/bin/python benchmarks/bench_http.py [--concurrency 1,4,16,64] [--llama-types f32,q4_1]
        [--peers llama,vllm] [--prompt-len 256] [--output-len 64] [--rounds 2] [--json out.json]
    .venv/bin/python benchmarks/bench_http.py --quick   # smoke run: 1 and 4 clients
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

# benchmarks/ is not installed: the repo root on the path makes it importable from this script.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.http_client import closed_loop, text_prompts  # noqa: E402
from benchmarks.engine.http_servers import PEERS, Side, free_port, make_sides  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from benchmarks.peers import llama_cpp, vllm_cpu  # noqa: E402
from quill.bench.client import summarize  # noqa: E402


def run_side(side: Side, prompts: list[str], warmup: list[str], clients: int, args) -> dict:
    """Start the side's server, warm it up, run the workload, stop it; the run's summary."""
    server = side.make(free_port())
    started = time.perf_counter()
    if side.start_timeout:
        server.start(side.start_timeout)
    else:
        server.start()
    try:
        start_s = time.perf_counter() - started
        asyncio.run(closed_loop(server.url, warmup, len(warmup), 8, side.extra_body))
        records = asyncio.run(
            closed_loop(server.url, prompts, clients, args.output_len, side.extra_body)
        )
    finally:
        server.stop()
    summary = summarize(records)
    ok = [r.prompt_tokens for r in records if r.ok and r.prompt_tokens is not None]
    summary["prompt_tokens_mean"] = statistics.mean(ok) if ok else None
    summary["start_s"] = start_s
    summary["command"] = server.cmd
    # ignore_eos: every request brings exactly output_len tokens, if its tokens are counted right.
    summary["miscounted"] = sum(r.output_tokens != args.output_len for r in records if r.ok)
    return summary


# --- the report ----------------------------------------------------------------------------------


def print_tables(results: dict, levels: list[int], peer_names: list[str]) -> None:
    m = results["machine"]
    vllm = f", vLLM {results['vllm']['version']}" if results.get("vllm") else ""
    print(
        f"\n{m['cpu']} ({' '.join(m['cpu_flags'])}), llama-server -t {m['threads']}{vllm}, "
        f"torch {m['torch']}, {m['date']}, {results['minutes']:.1f} min"
    )
    for name, why in results["skipped"].items():
        print(f"{name}: left out: {why}")
    runs = results["runs"]
    for peer in peer_names:
        print(f"\n### quill serve vs {peer} (ms; ratio < 1: quill lower)\n")
        print(
            "| clients | side | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | failed |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for c in levels:
            q, p = runs["quill"].get(str(c)), runs[peer].get(str(c))
            for name, s in (("quill", q), (peer, p)):
                if not s:
                    print(f"| {c} | {name} | - | - | - | - | - | - |")
                    continue
                lat = [s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["itl_ms"]["p50"]]
                lat.append(s["itl_ms"]["p99"])
                cells = " | ".join("-" if v is None else f"{v:.1f}" for v in lat)
                rate = s["output_throughput"] or 0.0
                fail = f"{s['num_failed']}/{s['num_requests']}"
                print(f"| {c} | {name} | {rate:.1f} | {cells} | {fail} |")
            if not q or not p:
                continue
            ratios = []
            for get in (
                lambda s: s["output_throughput"],
                lambda s: s["ttft_ms"]["p50"],
                lambda s: s["ttft_ms"]["p99"],
                lambda s: s["itl_ms"]["p50"],
                lambda s: s["itl_ms"]["p99"],
            ):
                a, b = get(q), get(p)
                ratios.append(a / b if a is not None and b else None)
            tok_s, ttft50, _, itl50, _ = ratios
            missed = [
                label
                for label, bad in (
                    ("tok/s", tok_s is None or tok_s < 1),
                    ("ITL p50", itl50 is None or itl50 > 1),
                    ("TTFT p50", ttft50 is None or ttft50 >= 1),
                )
                if bad
            ]
            cells = " | ".join("-" if r is None else f"{r:.2f}x" for r in ratios)
            target = "target met" if not missed else "missed: " + ", ".join(missed)
            print(f"| {c} | **quill / {peer}** | {cells} | {target} |")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default=None, help="streaming clients (1,4,16,64)")
    parser.add_argument(
        "--llama-types", default=None, help="GGUF types (f32,q4_1; bf16,q4_1 with avx512_bf16)"
    )
    parser.add_argument(
        "--peers",
        default=",".join(PEERS),
        help="the other sides: llama (llama-server on each --llama-types), vllm; '' for none",
    )
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=None, help="new tokens (64)")
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (2); best")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-server -t")
    parser.add_argument("--quick", action="store_true", help="1 and 4 clients, 32 tokens, 1 round")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    quick = ("1,4", 32, 1) if args.quick else ("1,4,16,64", 64, 2)
    args.concurrency = args.concurrency or quick[0]
    args.output_len = args.output_len or quick[1]
    args.rounds = args.rounds or quick[2]
    machine = machine_info(args.threads)
    if args.llama_types is None:
        bf16 = any(f in machine["cpu_flags"] for f in ("avx512_bf16", "amx_bf16"))
        args.llama_types = ("bf16" if bf16 else "f32") + ",q4_1"
    levels = [int(c) for c in args.concurrency.split(",") if c]
    llama_types = [t.strip() for t in args.llama_types.split(",") if t.strip()]
    peers = [p.strip() for p in args.peers.split(",") if p.strip()]
    if unknown := sorted(set(peers) - set(PEERS)):
        parser.error(f"--peers: unknown {', '.join(unknown)} (known: {', '.join(PEERS)})")
    seq_tokens = args.prompt_len + args.output_len
    sides, skipped = make_sides(llama_types, args.threads, seq_tokens, peers)
    for name, why in skipped.items():
        print(f"note: {name} left out: {why}", flush=True)
    print("sides: " + ", ".join(s.name for s in sides), flush=True)
    started = time.perf_counter()

    # The same texts go to every side; warm-up prompts are others, so no cache serves a run.
    prompts, warmups = {}, {}
    for c in levels:
        texts = text_prompts(c * args.requests_per_client + min(c, 4), args.prompt_len, seed=c)
        prompts[c], warmups[c] = texts[min(c, 4) :], texts[: min(c, 4)]
    runs: dict = {s.name: {} for s in sides}
    for rnd in range(args.rounds):
        for c in levels:
            for side in sides if rnd % 2 == 0 else sides[::-1]:
                try:
                    s = run_side(side, prompts[c], warmups[c], c, args)
                except Exception as e:  # one side failing must not lose the other's numbers
                    print(f"round {rnd + 1}, {c} clients, {side.name}: failed: {e}", flush=True)
                    continue
                best = runs[side.name].get(str(c))
                history = [*(best or {}).get("rounds_tok_s", []), s["output_throughput"]]
                if not best or (s["output_throughput"] or 0) > (best["output_throughput"] or 0):
                    best = s
                best["rounds_tok_s"] = history
                runs[side.name][str(c)] = best
                ttft, itl = s["ttft_ms"]["p50"], s["itl_ms"]["p50"]
                short = f", {s['miscounted']} not of {args.output_len} tokens"
                print(
                    f"round {rnd + 1}, {c} clients, {side.name}: "
                    f"{s['output_throughput'] or 0:.1f} tok/s, TTFT p50 {ttft or 0:.0f} ms, "
                    f"ITL p50 {itl or 0:.1f} ms, {s['num_failed']} failed"
                    + (f" ({s['errors'][0]})" if s["errors"] else "")
                    + (short if s["miscounted"] else ""),
                    flush=True,
                )
    try:
        llama_info = llama_cpp.build_info() if "llama" in peers else None
    except llama_cpp.PeerMissingError:
        llama_info = None
    vllm_info = None
    if any(s.name == "vllm" for s in sides):
        server = vllm_cpu.VllmServer(vllm_cpu.default_model_dir())  # not started: its settings
        env = ("VLLM_CPU_KVCACHE_SPACE", "VLLM_CPU_OMP_THREADS_BIND", "VLLM_TARGET_DEVICE")
        vllm_info = {
            "version": vllm_cpu.vllm_version(),
            "model": str(server.model),
            "env": {k: server.env[k] for k in env if k in server.env},
        }
    results = {
        "machine": machine,
        "settings": {
            k: getattr(args, k)
            for k in (
                "concurrency llama_types peers prompt_len output_len requests_per_client rounds"
                " quick"
            ).split()
        },
        "llama_cpp": llama_info,
        "vllm": vllm_info,
        "skipped": skipped,
        "runs": runs,
        "minutes": (time.perf_counter() - started) / 60,
    }
    print_tables(results, levels, [s.name for s in sides[1:]])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
