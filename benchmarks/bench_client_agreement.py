"""`quill bench serve` against guidellm on the same server at the same load: do they agree?

A benchmark client is only believed if an independent one, run the same way, reports the same
figures. This starts one `quill serve`, then alternates the two clients at each concurrency
(guidellm's `concurrent` profile with N streams; `quill bench serve --max-concurrency N
--request-rate inf`), the same prompt and reply lengths (synthetic prompts of the default
model's tokenizer, `ignore_eos`), the same number of measured requests, twice each, and reports
each side's output tokens/s, TTFT p50 and per-request time per output token p50 (guidellm calls
that "inter-token latency": the mean gap of each request, then the median over requests), and
the ratios quill / guidellm. Alternating keeps the machine's drift between minutes on both.

    bash benchmarks/peers/guidellm.sh     # once
    .venv/bin/python benchmarks/bench_client_agreement.py [--concurrency 1,4] [--rounds 2]
        [--out docs/results/bench_client_agreement.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed

from benchmarks.bench_guidellm import (  # noqa: E402
    OFFLINE,
    guidellm_command,
    guidellm_exe,
    served_model,
    warm_up,
)
from benchmarks.bench_guidellm import summarize as summarize_guidellm  # noqa: E402
from benchmarks.engine.http_servers import LOG_DIR, QuillServe, free_port  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.bench.stats import percentile  # noqa: E402


def run_guidellm(exe: str, url: str, model: str, clients: int, args, tag: str) -> dict:
    out = LOG_DIR / f"agree-guidellm-{tag}.json"
    out.unlink(missing_ok=True)
    cmd = guidellm_command(exe, url, model, clients, args, out)
    with open(LOG_DIR / f"agree-guidellm-{tag}.log", "w") as log:
        subprocess.run(cmd, env={**os.environ, **OFFLINE}, stdout=log, stderr=log, check=True)
    s = summarize_guidellm(json.loads(out.read_text()))
    return {
        "completed": s["requests_completed"],
        "failed": s["requests_failed"],
        "output_tok_s": s["output_tok_s"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "tpot_p50_ms": s["itl_ms"]["p50"],
    }


def run_quill(url: str, clients: int, args, seed: int, tag: str) -> dict:
    out = LOG_DIR / f"agree-quill-{tag}.json"
    cmd = [
        sys.executable, "-m", "quill.cli", "bench", "serve", "--base-url", url,
        "--num-prompts", str(clients * args.requests_per_client),
        "--max-concurrency", str(clients), "--request-rate", "inf",
        "--input-len", str(args.prompt_len), "--output-len", str(args.output_len),
        "--ignore-eos", "--seed", str(seed), "--no-progress", "--out", str(out),
    ]  # fmt: skip
    with open(LOG_DIR / f"agree-quill-{tag}.log", "w") as log:
        subprocess.run(cmd, stdout=log, stderr=log, check=True)
    run = json.loads(out.read_text())
    s = run["summary"]
    steady = steady_state(run["requests"], min(clients, 4))
    return {
        "completed": s["completed"],
        "failed": s["failed"],
        "output_tok_s": s["output_throughput"],
        "ttft_p50_ms": s["ttft_ms"]["p50"],
        "tpot_p50_ms": s["tpot_ms"]["p50"],
        # guidellm's rule applied to the same requests: what its figures would be here.
        "steady_ttft_p50_ms": percentile([r["ttft"] * 1000 for r in steady], 50),
        "steady_tpot_p50_ms": percentile([r["tpot"] * 1000 for r in steady], 50),
        "steady_requests": len(steady),
    }


def steady_state(requests: list[dict], warmup: int) -> list[dict]:
    """The requests guidellm would measure: it counts a request as warm-up when it started
    before the (warmup + 1)-th request ended, so the opening burst (N prompts at once into an
    idle server, which wait for each other's prefill) is left out of its percentiles."""
    ok = [r for r in requests if r["error"] is None]
    ends = sorted(r["ended"] for r in ok)
    if len(ends) <= warmup:
        return ok
    cutoff = ends[warmup]
    return [r for r in ok if r["sent"] >= cutoff]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default="1,4", help="streams, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="alternations per level")
    parser.add_argument("--requests-per-client", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--out", default=None, help="write the results JSON here")
    args = parser.parse_args()
    # What guidellm_command reads besides the above.
    args.endpoint, args.max_seconds = "completions", 600.0
    exe = guidellm_exe(None)
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    levels = [int(c) for c in args.concurrency.split(",") if c]
    started = time.perf_counter()
    results: dict = {"machine": machine_info(os.cpu_count()), "levels": {}}
    with QuillServe(free_port()) as server:
        model = served_model(server.url)
        warm_up(server.url, model, "completions")
        for c in levels:
            runs = {"guidellm": [], "quill": []}
            for r in range(args.rounds):
                tag = f"c{c}-r{r}"
                runs["guidellm"].append(run_guidellm(exe, server.url, model, c, args, tag))
                runs["quill"].append(run_quill(server.url, c, args, seed=r, tag=tag))
                print(f"{c} clients, round {r}: {runs['guidellm'][-1]} | {runs['quill'][-1]}")
            level = {"runs": runs, "median": {}, "ratio_quill_over_guidellm": {}}
            for key in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms"):
                g = statistics.median(x[key] for x in runs["guidellm"])
                q = statistics.median(x[key] for x in runs["quill"])
                level["median"][key] = {"guidellm": g, "quill": q}
                level["ratio_quill_over_guidellm"][key] = q / g if g else None
            for key in ("ttft_p50_ms", "tpot_p50_ms"):
                g = statistics.median(x[key] for x in runs["guidellm"])
                q = statistics.median(x[f"steady_{key}"] for x in runs["quill"])
                key = f"{key} (guidellm's warm-up rule)"
                level["median"][key] = {"guidellm": g, "quill": q}
                level["ratio_quill_over_guidellm"][key] = q / g if g else None
            results["levels"][str(c)] = level
        results["server_command"] = server.cmd
    results["settings"] = vars(args)
    results["minutes"] = (time.perf_counter() - started) / 60
    print("\n| clients | metric | guidellm | quill bench serve | quill / guidellm |")
    print("|---|---|---|---|---|")
    for c, level in results["levels"].items():
        for key, pair in level["median"].items():
            ratio = level["ratio_quill_over_guidellm"][key]
            print(f"| {c} | {key} | {pair['guidellm']:.1f} | {pair['quill']:.1f} | {ratio:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
