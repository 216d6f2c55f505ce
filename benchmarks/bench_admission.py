"""Admission control against overload: does `--max-ttft-slo` keep its promise, and how good is
the TTFT it predicts?

One `quill serve` with `--max-ttft-slo`, then one without, each sent the same overload: Poisson
arrivals faster than the server can take prompts in. For every request the client keeps the
status and the server's own `metrics` (predicted and actual time to first token). Reported: how
many were refused (503) and how many admitted ones still started past the SLO; the TTFT p50/p99
of the admitted ones beside the run without the SLO (which admits all, so its queue grows); and
the prediction's error on admitted requests (median and p90 of |predicted - actual| / actual).

    .venv/bin/python benchmarks/bench_admission.py [--slo-ms 5000] [--rate 1.0]
        [--requests 60] [--out docs/results/bench_admission.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed

from benchmarks.bench_guidellm import served_model, warm_up  # noqa: E402
from benchmarks.engine.http_servers import LOG_DIR, QuillServe, free_port  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.bench.datasets import random_requests  # noqa: E402
from quill.bench.prompts import ExactPrompts, load_tokenizer  # noqa: E402
from quill.bench.stats import percentile  # noqa: E402
from quill.sim.workload import LengthSpec, arrival_times  # noqa: E402


async def send_all(url: str, model: str, requests, arrivals, output_len: int) -> list[dict]:
    start = time.monotonic()
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:

        async def one(request, at: float) -> None:
            await asyncio.sleep(max(0.0, at - (time.monotonic() - start)))
            body = {
                "model": model,
                "prompt": request.prompt,
                "max_tokens": output_len,
                "ignore_eos": True,
                "temperature": 0,
            }
            r = await client.post("/v1/completions", json=body)
            record = {"status": r.status_code, "prompt_len": request.prompt_len}
            if r.status_code == 200:
                m = r.json()["metrics"]
                record["ttft_s"] = m["time_to_first_token"]
                record["predicted_ttft_s"] = m["predicted_time_to_first_token"]
                record["cached_tokens"] = m["num_cached_tokens"]
            else:
                record["error"] = r.json()["error"]["message"]
                record["retry_after"] = r.headers.get("Retry-After")
            results.append(record)

        await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals)))
    return results


def summarize(results: list[dict], slo_s: float | None) -> dict:
    served = [r for r in results if r["status"] == 200]
    ttft = [r["ttft_s"] for r in served]
    errors = [
        abs(r["predicted_ttft_s"] - r["ttft_s"]) / r["ttft_s"]
        for r in served
        if r["predicted_ttft_s"] is not None and r["ttft_s"]
    ]
    ratios = [r["predicted_ttft_s"] / r["ttft_s"] for r in served if r["ttft_s"]]
    return {
        "sent": len(results),
        "served": len(served),
        "refused_503": sum(r["status"] == 503 for r in results),
        "other_errors": sum(r["status"] not in (200, 503) for r in results),
        "served_past_slo": sum(t > slo_s for t in ttft) if slo_s else None,
        "ttft_p50_s": percentile(ttft, 50) if ttft else None,
        "ttft_p99_s": percentile(ttft, 99) if ttft else None,
        "ttft_max_s": max(ttft) if ttft else None,
        "prediction_error_p50": percentile(errors, 50) if errors else None,
        "prediction_error_p90": percentile(errors, 90) if errors else None,
        "predicted_over_actual_p50": percentile(ratios, 50) if ratios else None,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slo-ms", type=float, default=5000.0)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second")
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--input-len", default="256:1024")
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", type=Path, default=REPO / "docs/results/bench_admission.json")
    args = parser.parse_args()
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    tokenizer = load_tokenizer()
    requests = random_requests(
        args.requests,
        LengthSpec.parse(args.input_len),
        LengthSpec(args.output_len, args.output_len),
        ExactPrompts(tokenizer),
        args.seed,
    )
    arrivals = list(arrival_times(args.requests, args.rate, 1.0, args.seed))
    runs = {}
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    for label, slo_ms in (("with_slo", args.slo_ms), ("without_slo", None)):
        server = QuillServe(free_port())
        if slo_ms is not None:
            server.cmd += ["--max-ttft-slo", str(slo_ms)]
        server.log_path = LOG_DIR / f"admission-{label}.log"
        server.start()
        try:
            model = served_model(server.url)
            warm_up(server.url, model, "completions")
            results = asyncio.run(send_all(server.url, model, requests, arrivals, args.output_len))
        finally:
            server.stop()
        slo_s = slo_ms / 1000 if slo_ms else None
        runs[label] = {"summary": summarize(results, slo_s), "requests": results}
        print(label, json.dumps(runs[label]["summary"]), flush=True)
    result = {
        "benchmark": "TTFT admission control under overload",
        "date": started,
        "machine": machine_info(threads=os.cpu_count() or 1),
        "settings": {**vars(args), "out": str(args.out)},
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
