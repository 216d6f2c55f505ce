"""Soak test: minutes of mixed, partly hostile traffic against `quill serve`, then a verdict.

Why: unit tests send one request at a time; leaks (KV blocks never freed, memory that only
grows), crashes under disconnects and 5xx answers to bad input show up only after many
requests of every kind have interleaved. This starts `quill serve` (with an API key, a small
--max-queued-requests so that bursts overflow it, a short --request-body-timeout) and runs
--workers clients for --minutes, each drawing at random (seeded) among: streamed and plain
completions and chat; ~1500-token prompts; streams dropped after a few tokens; requests given
up on by a short client timeout; invalid requests (malformed JSON, wrong types, out-of-range
values, unknown model, oversized bodies, text/plain, missing or wrong API key, ...), each of
which must get its 4xx; raw sockets that send half a body and leave, or stall (408). Every
--burst-every seconds, --burst-size requests go at once, past the queue bound (503 with
Retry-After is the right answer there).

Reported: requests by outcome and kind, TTFT/ITL p50/p99 and output tokens/s per window, the
server's RSS at start, after the warm-up and at the end, and the /metrics gauges once the
traffic is over. Verdict (exit code 1 when it fails): no 5xx but 503, no unexpected failure, no
traceback in the server log, KV usage, running and waiting all 0 at the end, RSS grown less than
--rss-growth-limit % after the warm-up. Usage:

    .venv/bin/python benchmarks/soak.py                       # 10 minutes, docs/results/soak.json
    .venv/bin/python benchmarks/soak.py --minutes 1 --warmup-seconds 20 --out /tmp/soak.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import secrets
import shlex
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

# benchmarks/ is not installed: the repo root on the path makes it importable from this script.
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.engine.http_servers import QuillServe, free_port  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from benchmarks.soak import report  # noqa: E402
from benchmarks.soak.traffic import Recorder, Traffic  # noqa: E402

MAX_REQUEST_BYTES = 4 << 20  # quill serve's default --max-request-bytes, which the run keeps


class SoakServe(QuillServe):
    """bench_http's `quill serve`, plus the flags that make the guards reachable."""

    name = "quill serve (soak)"

    def __init__(
        self, port: int, api_key: str, max_queued: int, body_timeout: float, log_path: Path
    ) -> None:
        super().__init__(port)
        self.cmd += ["--api-key", api_key, "--max-queued-requests", str(max_queued)]
        self.cmd += ["--request-body-timeout", f"{body_timeout:g}"]
        self.log_path = log_path
        self.api_key = api_key

    def shown_cmd(self) -> str:
        """The command line, key hidden: the results file may be published."""
        return shlex.join("<key>" if c == self.api_key else c for c in self.cmd)


def server_rss(pid: int) -> int | None:
    """Resident bytes of the server and any process it started."""
    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
        return sum(p.memory_info().rss for p in procs)
    except psutil.Error:
        return None


async def read_gauges(client: httpx.AsyncClient) -> dict[str, float] | None:
    try:
        response = await client.get("/metrics", timeout=10)
        response.raise_for_status()
        return report.parse_gauges(response.text)
    except (httpx.HTTPError, ValueError):
        return None


async def soak(server: SoakServe, args: argparse.Namespace) -> dict:
    """Run the traffic against a started server; returns the measurements (no verdict yet)."""
    pid = server.proc.pid
    host, port = "127.0.0.1", int(server.url.rsplit(":", 1)[1])
    rec = Recorder()
    # No connection limit: a burst must reach the server at once, not queue in the client.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    headers = {"Authorization": f"Bearer {server.api_key}"}
    async with httpx.AsyncClient(
        base_url=server.url, headers=headers, timeout=600, limits=limits
    ) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        traffic = Traffic(
            client,
            model,
            host,
            port,
            server.api_key,
            args.request_body_timeout,
            MAX_REQUEST_BYTES,
            rec,
        )
        rss_start = server_rss(pid)
        samples: list[dict] = []
        t0 = time.monotonic()
        deadline = t0 + args.minutes * 60
        died = False

        async def sample() -> dict:
            s = {"t": time.monotonic(), "rss_bytes": server_rss(pid)}
            s |= await read_gauges(client) or {}
            samples.append(s)
            return s

        async def sampler() -> None:
            # Sample at each window's end, and once exactly at the end of the warm-up.
            nonlocal died
            num_windows = int(args.minutes * 60 // args.window_seconds)
            marks = sorted(
                {t0 + args.warmup_seconds, deadline}
                | {t0 + k * args.window_seconds for k in range(1, num_windows + 1)}
            )
            for mark in marks:
                if mark > deadline:
                    break
                await asyncio.sleep(max(0.0, mark - time.monotonic()))
                await sample()
                if server.proc is None or server.proc.poll() is not None:
                    died = True
                    return

        names = list(Traffic.KINDS)
        weights = [Traffic.KINDS[n] for n in names]

        async def worker(i: int) -> None:
            rng = random.Random(f"{args.seed}-worker-{i}")
            while time.monotonic() < deadline and not died:
                await traffic.run(rng.choices(names, weights)[0], rng)

        async def hostile(i: int) -> None:
            # Workers spend most of their time waiting for tokens, so on a slow machine they
            # would draw few invalid requests; this loop sends every case, over and over.
            rng = random.Random(f"{args.seed}-hostile-{i}")
            cases = traffic.hostile_cases()
            while not died:
                rng.shuffle(cases)
                for case in cases:
                    if time.monotonic() >= deadline or died:
                        return
                    await traffic.hostile(case, rng)
                    await asyncio.sleep(args.hostile_pause)

        async def bursts() -> None:
            rng = random.Random(f"{args.seed}-bursts")
            fired = []
            at = t0 + args.burst_every / 2
            while at < deadline and not died:
                await asyncio.sleep(max(0.0, at - time.monotonic()))
                # A task, not awaited: a slow burst must not push the next one back.
                fired.append(asyncio.create_task(traffic.burst(rng, args.burst_size)))
                at += args.burst_every
            await asyncio.gather(*fired)

        sampling = asyncio.create_task(sampler())
        running = [asyncio.create_task(worker(i)) for i in range(args.workers)]
        running += [asyncio.create_task(hostile(i)) for i in range(args.hostile_workers)]
        running.append(asyncio.create_task(bursts()))
        # Every request started before the deadline is let finish: the drain is part of the test.
        done, pending = await asyncio.wait(running, timeout=args.minutes * 60 + args.drain_seconds)
        for task in pending:
            task.cancel()
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        end = time.monotonic()
        sampling.cancel()

        # Gauges update once per engine step; give the last aborts a moment to be stepped.
        final = None
        settle_deadline = time.monotonic() + args.settle_seconds
        while time.monotonic() < settle_deadline:
            final = await read_gauges(client)
            if final is not None and not any(final.values()):
                break
            await asyncio.sleep(0.5)
        settled_s = time.monotonic() - end
        last = await sample()

    warm = next((s for s in samples if s["t"] >= t0 + args.warmup_seconds - 0.5), None)
    rss_values = [s["rss_bytes"] for s in samples if s["rss_bytes"] is not None]
    rss = {
        "start_bytes": rss_start,
        "after_warmup_bytes": warm["rss_bytes"] if warm else None,
        "end_bytes": last["rss_bytes"],
        "peak_bytes": max(rss_values, default=None),
        "growth_after_warmup_pct": None,
        "growth_after_warmup_mib": None,
    }
    if rss["after_warmup_bytes"] and rss["end_bytes"]:
        grown = rss["end_bytes"] - rss["after_warmup_bytes"]
        rss["growth_after_warmup_mib"] = grown / 2**20
        rss["growth_after_warmup_pct"] = 100 * grown / rss["after_warmup_bytes"]
    outcomes, by_traffic = report.counts(rec)
    if pending:
        outcomes["failure"] = outcomes.get("failure", 0) + len(pending)
    fails = report.failures(rec, t0)
    if pending:
        fails["count"] += len(pending)
        fails["by_reason"][f"client tasks still running {args.drain_seconds:g} s after"] = len(
            pending
        )
    return {
        "duration_s": min(end, deadline) - t0,
        "drain_s": max(0.0, end - deadline),
        "settle_s": settled_s,
        "outcomes": outcomes,
        "by_traffic": by_traffic,
        "failures": fails,
        "windows": report.windows(
            rec, samples, t0, deadline, args.window_seconds, args.warmup_seconds
        ),
        "overall": {
            "ttft_ms": report.summary([v for _, v in rec.ttft]),
            "itl_ms": report.summary([v for _, v in rec.itl]),
            "output_tokens": sum(n for _, n in rec.tokens),
        },
        "rss": rss,
        "final_gauges": final,
        "died_during_run": died,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--minutes", type=float, default=10.0, help="traffic time (10)")
    parser.add_argument(
        "--warmup-seconds",
        type=float,
        default=60.0,
        help="first part of the traffic after which RSS is the baseline (60)",
    )
    parser.add_argument("--window-seconds", type=float, default=30.0, help="report window (30)")
    parser.add_argument("--workers", type=int, default=8, help="concurrent client loops (8)")
    parser.add_argument(
        "--hostile-workers", type=int, default=1, help="loops cycling through bad input (1)"
    )
    parser.add_argument(
        "--hostile-pause", type=float, default=0.25, help="seconds between their requests"
    )
    parser.add_argument("--burst-size", type=int, default=60, help="requests per burst (60)")
    parser.add_argument("--burst-every", type=float, default=60.0, help="seconds between (60)")
    parser.add_argument(
        "--max-queued-requests", type=int, default=32, help="the server's queue bound (32)"
    )
    parser.add_argument(
        "--request-body-timeout", type=float, default=5.0, help="the server's body timeout (5)"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--drain-seconds", type=float, default=300.0, help="wait for requests in flight (300)"
    )
    parser.add_argument(
        "--settle-seconds", type=float, default=30.0, help="wait for the gauges to reach 0 (30)"
    )
    parser.add_argument(
        "--rss-growth-limit", type=float, default=5.0, help="%% RSS growth allowed (5)"
    )
    parser.add_argument("--out", default=str(ROOT / "docs" / "results" / "soak.json"))
    parser.add_argument(
        "--server-log", default=str(Path(tempfile.gettempdir()) / "quill-soak" / "quill-serve.log")
    )
    args = parser.parse_args()
    if args.warmup_seconds >= args.minutes * 60:
        parser.error("--warmup-seconds must be shorter than the run")

    server = SoakServe(
        free_port(),
        secrets.token_urlsafe(16),
        args.max_queued_requests,
        args.request_body_timeout,
        Path(args.server_log),
    )
    print(f"starting {server.shown_cmd()} (log: {server.log_path})", flush=True)
    server.start()
    proc = server.proc
    try:
        print(f"server up (pid {proc.pid}); {args.minutes:g} min of traffic", flush=True)
        measured = asyncio.run(soak(server, args))
    finally:
        server.stop()  # SIGTERM, then SIGKILL after 15 s
    died = measured.pop("died_during_run")
    machine = machine_info(os.cpu_count() or 1)
    results = {
        "machine": machine,
        "command": machine["command"],
        "date": machine["date"],
        "server_command": server.shown_cmd(),
        "settings": {
            k: getattr(args, k)
            for k in (
                "minutes warmup_seconds window_seconds workers hostile_workers hostile_pause "
                "burst_size burst_every "
                "max_queued_requests request_body_timeout seed rss_growth_limit"
            ).split()
        },
        "traffic_weights": Traffic.KINDS,
        **measured,
        "server": {
            "exit_code": proc.returncode,
            "died_during_run": died,
        },
        "server_log": report.scan_server_log(server.log_path),
    }
    results["settings"]["burst_every_s"] = results["settings"].pop("burst_every")
    results["verdict"] = report.verdict(results, args.rss_growth_limit)
    report.print_report(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if results["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
