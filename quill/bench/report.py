"""A benchmark run told two ways: a plain-text table for the terminal, JSON for later analysis.

The JSON holds everything needed to recompute any figure (every request's send time, chunk
arrival times and token counts) beside the summary and the settings that produced it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from quill.bench.stats import tpot
from quill.bench.stream import StreamRecord

_WIDTH = 64


def record_dict(record: StreamRecord) -> dict:
    """One request's timings, in seconds from the start of the run."""
    ok = record.ok
    return {
        "index": record.index,
        "scheduled": record.scheduled,
        "sent": record.sent,
        "ended": record.ended,
        "ttft": record.ttft if ok else None,
        "tpot": tpot(record.e2e, record.ttft, record.output_tokens) if ok else None,
        "e2e": record.e2e if ok else None,
        "itls": record.itls,
        "chunk_times": record.chunk_times,
        "chunk_tokens": record.chunk_tokens,
        "prompt_len": record.prompt_len,
        "prompt_tokens": record.prompt_tokens,
        "max_tokens": record.max_tokens,
        "output_tokens": record.output_tokens,
        "token_source": record.token_source,
        "status": record.status,
        "error": record.error,
    }


def write_json(
    path: str | Path, settings: dict, summary: dict, records: Sequence[StreamRecord]
) -> None:
    payload = {
        "settings": settings,
        "summary": summary,
        "requests": [record_dict(r) for r in records],
    }
    Path(path).write_text(json.dumps(payload, indent=1) + "\n")


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def format_table(summary: dict, settings: dict) -> str:
    """The run's figures as aligned plain text."""
    rate = settings["request_rate"]
    cap = settings["max_concurrency"]
    slo = summary["slo"]
    if slo is None:
        goodput = "no SLO given"
    else:
        limits = ", ".join(f"{k[:-3]} <= {v:g} ms" for k, v in slo.items() if v is not None)
        goodput = f"{_number(summary['goodput'])} ({summary['good_requests']} met {limits})"
    sources = summary["token_sources"]
    counted = ", ".join(f"{k} ({v})" for k, v in sorted(sources.items())) or "-"
    input_note = "server's usage" if "usage" in sources else "client's tokenizer"
    if settings["endpoint"] != "completions" and "usage" in sources:
        input_note += " (chat template included)"
    rows = [
        ("Endpoint", settings["url"]),
        ("Model", settings["model"]),
        ("Request rate (req/s)", f"{rate} (burstiness {settings['burstiness']:g})"),
        ("Max concurrency", "none" if cap is None else str(cap)),
        ("Successful requests", str(summary["completed"])),
        ("Failed requests", str(summary["failed"])),
        ("Benchmark duration (s)", _number(summary["duration_s"])),
        ("Total input tokens", str(summary["total_input_tokens"])),
        ("Input tokens counted by", input_note),
        ("Total output tokens", str(summary["total_output_tokens"])),
        ("Output tokens counted from", counted),
        ("Request throughput (req/s)", _number(summary["request_throughput"])),
        ("Output token throughput (tok/s)", _number(summary["output_throughput"])),
        ("Peak output token throughput (tok/s, 1 s)", _number(summary["peak_output_throughput"])),
        ("Total token throughput (tok/s)", _number(summary["total_token_throughput"])),
        ("Goodput (req/s)", goodput),
    ]
    key_width = max(len(k) for k, _ in rows) + 2
    lines = [" quill bench serve ".center(_WIDTH, "=")]
    lines += [f"{k + ':':<{key_width}}{v}" for k, v in rows]
    lines.append(" latency (ms) ".center(_WIDTH, "-"))
    columns = ("mean", "p50", "p90", "p99", "max")
    lines.append(f"{'':<6}" + "".join(f"{c:>11}" for c in columns) + f"{'n':>8}")
    for name in ("ttft", "tpot", "itl", "e2e"):
        figures = summary[f"{name}_ms"]
        cells = "".join(f"{_number(figures[c]):>11}" for c in columns)
        lines.append(f"{name.upper():<6}{cells}{figures['count']:>8}")
    if summary["errors"]:
        lines.append(" failed requests ".center(_WIDTH, "-"))
        for e in summary["errors"]:  # an HTTP error's reason starts with its status
            lines.append(f"{e['count']:>4} x {e['error']}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)
