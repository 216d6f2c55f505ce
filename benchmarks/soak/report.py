"""The soak test's report: per-window latencies, the counts, the server's log and the verdict.

A leak or a slow degradation shows as a trend, not as one number, so latencies and throughput
are cut into fixed windows of the run and resident memory is sampled at each window's end. The
verdict is the issue's: no 5xx but 503, no unexpected failure, no KV block held once the
traffic is gone, and resident memory grown by less than the limit after the warm-up.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from benchmarks.soak.traffic import Recorder
from quill.sim.metrics import Distribution

GAUGES = {
    "quill:kv_cache_usage_perc": "kv_cache_usage_perc",
    "quill:num_requests_running": "num_requests_running",
    "quill:num_requests_waiting": "num_requests_waiting",
}
_METRIC_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")
_ACCESS_STATUS = re.compile(r'"[A-Z]+ \S+ HTTP/[\d.]+" (\d{3})')


def parse_gauges(text: str) -> dict[str, float]:
    """The three gauges the verdict reads from a /metrics page, summed over their labels."""
    out = dict.fromkeys(GAUGES.values(), 0.0)
    seen = set()
    for line in text.splitlines():
        m = _METRIC_LINE.match(line)
        if m and m.group(1) in GAUGES:
            key = GAUGES[m.group(1)]
            out[key] += float(m.group(3))
            seen.add(key)
    missing = set(GAUGES.values()) - seen
    if missing:
        raise ValueError(f"/metrics lacks {', '.join(sorted(missing))}")
    return out


def summary(values: list[float]) -> dict:
    """count, p50, p99 and max of values in seconds, in ms."""
    d = Distribution()
    for v in values:
        d.add(v)
    s = d.summary(1000)
    return {"count": s["count"], "p50": s["p50"], "p99": s["p99"], "max": s["max"]}


def windows(
    rec: Recorder, samples: list[dict], t0: float, end: float, width: float, warmup: float
) -> list[dict]:
    """Each `width` seconds of traffic: requests ended by outcome, TTFT and ITL (ms), output
    tokens/s, and the last server sample (RSS, gauges) taken by the window's end."""
    out = []
    count = max(1, -int(-(end - t0) // width))
    for k in range(count):
        lo, hi = t0 + k * width, min(t0 + (k + 1) * width, end)
        if k == count - 1:
            hi = float("inf")  # requests still finishing after the deadline belong to the last
        ended = Counter(o.outcome for o in rec.outcomes if lo <= o.ended < hi)
        tokens = sum(n for t, n in rec.tokens if lo <= t < hi)
        span = min(hi, end) - lo
        server = None
        for s in samples:
            if s["t"] <= min(hi, end) + 1.0:
                server = {key: v for key, v in s.items() if key != "t"}
        out.append(
            {
                "start_s": round(lo - t0, 1),
                "end_s": round(min(hi, end) - t0, 1),
                "warmup": lo - t0 < warmup,
                "requests": sum(ended.values()),
                "outcomes": dict(sorted(ended.items())),
                "ttft_ms": summary([v for t, v in rec.ttft if lo <= t < hi]),
                "itl_ms": summary([v for t, v in rec.itl if lo <= t < hi]),
                "output_tokens": tokens,
                "output_tokens_per_s": tokens / span if span > 0 else None,
                "server": server,
            }
        )
    return out


def counts(rec: Recorder) -> tuple[dict, dict]:
    """Outcomes overall, and per kind of traffic."""
    overall = Counter(o.outcome for o in rec.outcomes)
    per: dict[str, Counter] = {}
    for o in rec.outcomes:
        per.setdefault(o.traffic, Counter())[o.outcome] += 1
    per_traffic = {name: dict(sorted(c.items())) for name, c in sorted(per.items())}
    return dict(sorted(overall.items())), per_traffic


def failures(rec: Recorder, t0: float, limit: int = 20) -> dict:
    """Unexpected failures grouped by reason, with a few examples of each."""
    bad = [o for o in rec.outcomes if o.outcome == "failure"]
    reasons: Counter = Counter()
    examples = []
    for o in bad:
        # Numbers differ from one occurrence to the next; the reason is what is left.
        key = re.sub(r"\d+(\.\d+)?", "N", o.detail or "")[:120]
        reasons[key] += 1
        if reasons[key] <= 3 and len(examples) < limit:
            at = round(o.started - t0, 1)
            examples.append({"traffic": o.traffic, "at_s": at, "detail": o.detail})
    return {"count": len(bad), "by_reason": dict(reasons.most_common()), "examples": examples}


def scan_server_log(path: Path, max_excerpts: int = 3, excerpt_lines: int = 40) -> dict:
    """What the server logged that a client cannot see: tracebacks, errors, and the statuses
    of its access log (a cross-check of the client's counts)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return {"path": str(path), "error": str(e)}
    statuses: Counter = Counter()
    tracebacks, errors, excerpts = 0, [], []
    for i, line in enumerate(lines):
        m = _ACCESS_STATUS.search(line)
        if m:
            statuses[m.group(1)] += 1
        if line.startswith("Traceback"):
            tracebacks += 1
            if len(excerpts) < max_excerpts:
                # The log line before a traceback says what was being done.
                excerpts.append("\n".join(lines[max(0, i - 2) : i + excerpt_lines]))
        if line.startswith(("ERROR", "CRITICAL")) and len(errors) < 20:
            errors.append(line)
    return {
        "path": str(path),
        "lines": len(lines),
        "tracebacks": tracebacks,
        "error_lines": errors,
        "traceback_excerpts": excerpts,
        "access_log_statuses": dict(sorted(statuses.items())),
    }


def verdict(results: dict, rss_limit_pct: float) -> dict:
    """Pass or fail, with every reason it failed."""
    reasons = []
    fivexx = {
        code: n
        for code, n in results["server_log"].get("access_log_statuses", {}).items()
        if code.startswith("5") and code != "503"
    }
    if fivexx:
        reasons.append(f"server answered 5xx other than 503: {fivexx}")
    if results["failures"]["count"]:
        reasons.append(f"{results['failures']['count']} unexpected failures")
    gauges = results["final_gauges"]
    if gauges is None:
        reasons.append("could not read /metrics at the end")
    else:
        for key, value in gauges.items():
            if value != 0:
                reasons.append(f"{key} is {value} after the traffic ended (want 0)")
    growth = results["rss"].get("growth_after_warmup_pct")
    if growth is None:
        reasons.append("no RSS measurement")
    elif growth >= rss_limit_pct:
        reasons.append(f"RSS grew {growth:.1f}% after warm-up (limit {rss_limit_pct:g}%)")
    log = results["server_log"]
    if log.get("tracebacks"):
        reasons.append(f"{log['tracebacks']} traceback(s) in the server log")
    if results["server"]["exit_code"] not in (0, None):
        reasons.append(f"server exited with {results['server']['exit_code']}")
    if results["server"].get("died_during_run"):
        reasons.append("the server died during the run")
    return {"pass": not reasons, "reasons": reasons}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def print_report(results: dict) -> None:
    m, s = results["machine"], results["settings"]
    print(
        f"\n## quill soak: {results['duration_s'] / 60:.1f} min of traffic, {s['workers']} "
        f"workers + {s['hostile_workers']} hostile, bursts of {s['burst_size']} every "
        f"{s['burst_every_s']:g} s, seed {s['seed']}"
    )
    print(f"{m['cpu']} ({' '.join(m['cpu_flags'])}), {m['logical_cpus']} CPUs, {m['date']}\n")

    print("| outcome | requests |\n|---|---|")
    for outcome, n in results["outcomes"].items():
        print(f"| {outcome} | {n} |")
    print(f"| **total** | {sum(results['outcomes'].values())} |")

    names = sorted({o for v in results["by_traffic"].values() for o in v})
    print("\n| traffic | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 1) + "|")
    for traffic, row in results["by_traffic"].items():
        print(f"| {traffic} | " + " | ".join(str(row.get(n, "")) for n in names) + " |")

    print(
        "\n| window (s) | requests | ok | 503 | failed | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 "
        "| out tok/s | RSS MiB | KV % | running | waiting |"
    )
    print("|---" * 14 + "|")
    for w in results["windows"]:
        o, srv = w["outcomes"], w["server"] or {}
        label = f"{w['start_s']:.0f}-{w['end_s']:.0f}" + (" (warm-up)" if w["warmup"] else "")
        rss = srv.get("rss_bytes")
        kv = srv.get("kv_cache_usage_perc")
        cells = [
            label,
            str(w["requests"]),
            str(o.get("ok", 0)),
            str(o.get("503", 0)),
            str(o.get("failure", 0)),
            _ms(w["ttft_ms"]["p50"]),
            _ms(w["ttft_ms"]["p99"]),
            _ms(w["itl_ms"]["p50"]),
            _ms(w["itl_ms"]["p99"]),
            "-" if w["output_tokens_per_s"] is None else f"{w['output_tokens_per_s']:.1f}",
            "-" if rss is None else f"{rss / 2**20:.0f}",
            "-" if kv is None else f"{kv * 100:.1f}",
            str(srv.get("num_requests_running", "-")),
            str(srv.get("num_requests_waiting", "-")),
        ]
        print("| " + " | ".join(cells) + " |")

    r = results["rss"]

    def mib(key: str) -> str:
        return "-" if r.get(key) is None else f"{r[key] / 2**20:.0f} MiB"

    growth = r.get("growth_after_warmup_pct")
    print(
        f"\nRSS: start {mib('start_bytes')}, after warm-up {mib('after_warmup_bytes')}, "
        f"end {mib('end_bytes')}, peak {mib('peak_bytes')}; growth after warm-up "
        + ("-" if growth is None else f"{growth:+.2f}% ({r['growth_after_warmup_mib']:+.0f} MiB)")
    )
    print(f"final gauges: {results['final_gauges']}")
    log = results["server_log"]
    print(
        f"server log ({log.get('path')}): {log.get('tracebacks', '?')} tracebacks, "
        f"{len(log.get('error_lines', []))} ERROR lines, statuses {log.get('access_log_statuses')}"
    )
    f = results["failures"]
    if f["count"]:
        print(f"\nunexpected failures ({f['count']}):")
        for reason, n in f["by_reason"].items():
            print(f"  {n} x {reason}")
    v = results["verdict"]
    print("\nverdict: " + ("PASS" if v["pass"] else "FAIL: " + "; ".join(v["reasons"])))
