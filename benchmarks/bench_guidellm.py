"""guidellm against `quill serve`: a widely used third-party benchmark client, end to end.

Why: people benchmark an OpenAI-compatible server with the client they already use, not ours,
and those clients send vLLM's extensions. guidellm streams every request with
stream_options {"include_usage": true, "continuous_usage_stats": true} and asks for a fixed
output length with ignore_eos (max_completion_tokens on chat); before quill accepted these,
every one of its requests was refused with 400. This runs the real client, installed in its
own virtual environment by benchmarks/peers/guidellm.sh (its dependencies, torch,
transformers, datasets and pinned versions of click and pydantic, stay out of quill's .venv),
against `quill serve` with its defaults, and
reports guidellm's own numbers: requests completed and failed, output tokens/s, and TTFT and
inter-token latency percentiles as guidellm measures them (from its own timestamps, counting
tokens from the usage that quill puts in every chunk).

Workload: one `quill serve --port P` for the whole run. For each concurrency N, guidellm's
`concurrent` profile (N streams, each sending its next request when the last ends) sends
min(N, 4) warm-up requests, left out of its metrics, then N * --requests-per-client measured
ones (or stops at --max-seconds), of synthetic prompts of --prompt-len tokens of the default
model's tokenizer (read from its local directory: nothing is downloaded) and --output-len new
tokens. By guidellm's rule a request is a warm-up one when it started before the (k+1)-th
completed, so a level measures somewhat fewer requests than it sends; one request of our own
before the first level keeps the server's one-off first-request cost out of every level.
guidellm's client runs on the same CPUs as the server, so on a small machine its own cost
shows in the numbers; guidellm's warnings (e.g. "bottlenecked by the data generation")
are kept in the summary. Usage:

    bash benchmarks/peers/guidellm.sh      # once: installs guidellm, prints its path
    .venv/bin/python benchmarks/bench_guidellm.py [--concurrency 1,4,16]
        [--requests-per-client 4] [--prompt-len 256] [--output-len 64]
        [--endpoint completions|chat] [--out docs/results/bench_guidellm.json]
    .venv/bin/python benchmarks/bench_guidellm.py --quick   # smoke run: 1 client, 2 requests
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# benchmarks/ is not installed: the repo root on the path makes it importable from this script.
sys.path.insert(0, str(REPO))

from benchmarks.engine.http_servers import LOG_DIR, QuillServe, free_port  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.model.default_model import default_model_dir  # noqa: E402

INSTALLER = REPO / "benchmarks" / "peers" / "guidellm.sh"
ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
# guidellm loads its tokenizer through transformers and its data through datasets: both must
# read local files only.
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def guidellm_exe(given: str | None) -> str:
    """The guidellm executable: --guidellm, or the one guidellm.sh installs (a no-op if there)."""
    if given:
        return given
    out = subprocess.run(["bash", str(INSTALLER)], check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as resp:
        return json.load(resp)["data"][0]["id"]


def warm_up(url: str, model: str, endpoint: str) -> float:
    """One short request, so that the server's one-off first-request cost is in no level's
    numbers; its seconds."""
    body: dict = {"model": model, "max_tokens": 8, "ignore_eos": True}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "Warm up."}]
    else:
        body["prompt"] = "Warm up."
    req = urllib.request.Request(
        url + ENDPOINTS[endpoint],
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    t = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        resp.read()
    return time.perf_counter() - t


def guidellm_command(exe: str, url: str, model: str, clients: int, args, out: Path) -> list[str]:
    backend = {
        "kind": "openai_http",
        "target": url,
        "model": model,
        "request_format": ENDPOINTS[args.endpoint],
    }
    warmup = min(clients, 4)
    profile = {
        "kind": "concurrent",
        "streams": [clients],
        "warmup": {"mode": "requests", "value": warmup},
    }
    requests = clients * args.requests_per_client + warmup
    return [
        exe, "run",
        "--backend", json.dumps(backend),
        "--profile", json.dumps(profile),
        "--constraint", f"kind=max_requests,count={requests}",
        "--constraint", f"kind=max_duration,seconds={args.max_seconds}",
        "--tokenizer", f"kind=huggingface_auto,model={default_model_dir()}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_len},output_tokens={args.output_len}",
        "--output", f"kind=json,path={out}",
        "--disable-console-interactive",
    ]  # fmt: skip


def summarize(report: dict) -> dict:
    """The numbers of guidellm's JSON report that the table shows, as guidellm computed them."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m["request_totals"]
    ok = totals["successful"] > 0

    def pcts(name: str) -> dict:
        p = m[name]["successful"]["percentiles"]
        return {"p50": p["p50"] if ok else None, "p99": p["p99"] if ok else None}

    errored = bench["requests"].get("errored") or []
    errors = sorted({str((r.get("info") or {}).get("error")) for r in errored})[:5]
    # What guidellm sent, without its synthetic text (errored requests do not keep it).
    sent = (bench["requests"].get("successful") or errored or [{}])[0].get("request_args")
    body = (json.loads(sent) if sent else {}).get("body") or None
    for key in ("prompt", "messages"):
        if body and key in body:
            body[key] = "..."
    return {
        "requests_completed": totals["successful"],
        "requests_failed": totals["errored"],
        "requests_incomplete": totals["incomplete"],
        "output_tok_s": m["output_tokens_per_second"]["total"]["mean"] if ok else None,
        "ttft_ms": pcts("time_to_first_token_ms"),
        "itl_ms": pcts("inter_token_latency_ms"),
        "prompt_tokens_mean": m["prompt_token_count"]["successful"]["mean"] if ok else None,
        "output_tokens_mean": m["output_token_count"]["successful"]["mean"] if ok else None,
        "duration_s": bench["duration"],
        "warnings": [w.get("message") for w in bench.get("warnings") or []],
        "errors": errors,
        "request_body": body,
    }


def print_table(results: dict) -> None:
    m = results["machine"]
    print(
        f"\nguidellm {results['guidellm_version']} against quill serve ({results['model']}, "
        f"{results['settings']['endpoint']}), {m['cpu']}, {m['logical_cpus']} CPUs, {m['date']}\n"
    )
    print(
        "| clients | completed | failed | output tok/s | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c, s in results["runs"].items():
        if "error" in s:
            print(f"| {c} | - | - | - | - | - | - | - |  ({s['error']})")
            continue
        lat = [s["ttft_ms"]["p50"], s["ttft_ms"]["p99"], s["itl_ms"]["p50"], s["itl_ms"]["p99"]]
        cells = " | ".join("-" if v is None else f"{v:.1f}" for v in lat)
        rate = "-" if s["output_tok_s"] is None else f"{s['output_tok_s']:.1f}"
        print(f"| {c} | {s['requests_completed']} | {s['requests_failed']} | {rate} | {cells} |")
    print("\n(latencies in ms, as guidellm reports them)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--concurrency", default=None, help="streams, comma-separated (1,4,16)")
    parser.add_argument("--requests-per-client", type=int, default=None, help="measured (4)")
    parser.add_argument("--max-seconds", type=float, default=None, help="cap per level (300)")
    parser.add_argument("--prompt-len", type=int, default=256, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=None, help="new tokens (64)")
    parser.add_argument("--endpoint", choices=sorted(ENDPOINTS), default="completions")
    parser.add_argument("--guidellm", default=None, help="guidellm executable (guidellm.sh's)")
    parser.add_argument("--quick", action="store_true", help="1 client, 2 requests, 16 tokens")
    parser.add_argument("--out", default=None, help="write the summary JSON here")
    args = parser.parse_args()
    quick = ("1", 2, 16, 60.0) if args.quick else ("1,4,16", 4, 64, 300.0)
    args.concurrency = args.concurrency or quick[0]
    args.requests_per_client = args.requests_per_client or quick[1]
    args.output_len = args.output_len or quick[2]
    args.max_seconds = args.max_seconds or quick[3]
    levels = [int(c) for c in args.concurrency.split(",") if c]

    exe = guidellm_exe(args.guidellm)
    machine = machine_info(os.cpu_count())
    started = time.perf_counter()
    env = {**os.environ, **OFFLINE}
    LOG_DIR.mkdir(parents=True, exist_ok=True)
    runs: dict = {}
    version = None
    with QuillServe(free_port()) as server:
        model = served_model(server.url)
        warmup_s = warm_up(server.url, model, args.endpoint)
        for c in levels:
            out = LOG_DIR / f"guidellm-c{c}.json"
            log = LOG_DIR / f"guidellm-c{c}.log"
            out.unlink(missing_ok=True)
            cmd = guidellm_command(exe, server.url, model, c, args, out)
            print(f"{c} clients: guidellm run (log: {log})", flush=True)
            with open(log, "w") as f:
                proc = subprocess.run(
                    cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                    timeout=args.max_seconds + 300,
                )  # fmt: skip
            if proc.returncode != 0 or not out.exists():
                tail = log.read_text().splitlines()[-5:]
                runs[str(c)] = {"error": f"guidellm exited {proc.returncode}", "log_tail": tail}
                print(f"{c} clients: failed: {' / '.join(tail)}", flush=True)
                continue
            report = json.loads(out.read_text())
            version = report["metadata"].get("guidellm_version")
            s = summarize(report) | {"raw_report": str(out), "command": cmd}
            runs[str(c)] = s
            print(
                f"{c} clients: {s['requests_completed']} completed, {s['requests_failed']} "
                f"failed, {s['output_tok_s'] or 0:.1f} output tok/s"
                + (f" ({s['errors'][0]})" if s["errors"] else ""),
                flush=True,
            )
        server_cmd = server.cmd
    results = {
        "machine": machine,
        "guidellm_version": version,
        "guidellm": exe,
        "model": model,
        "server_command": server_cmd,
        "server_warmup_s": warmup_s,
        "settings": {
            k: getattr(args, k)
            for k in (
                "concurrency requests_per_client max_seconds prompt_len output_len endpoint quick"
            ).split()
        },
        "runs": runs,
        "minutes": (time.perf_counter() - started) / 60,
    }
    print_table(results)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
