"""The figures of a serving benchmark, as pure functions of what the client timed.

Kept apart from the HTTP side so that every number in a report can be checked by hand on a
few made-up requests. Conventions, as vLLM's `vllm bench serve` uses them so the figures
compare:

- percentiles interpolate linearly between the two nearest ranks (numpy's default);
- ITL is every gap between two chunks that carried text, over all requests;
- TPOT is a request's (e2e - TTFT) / (output tokens - 1), averaged over requests;
- throughput divides by the run's duration, from its start to the end of its last request;
- goodput counts requests that met every SLO given (the `itl` objective is held against the
  request's TPOT, its mean inter-token latency, as `quill simulate` does).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Protocol

from quill.sim.metrics import SLO, percentile

PERCENTILES = (50, 90, 99)


class Timed(Protocol):
    """What the figures need of a request (quill.bench.stream.StreamRecord has it)."""

    ok: bool
    ttft: float | None
    itls: list[float]
    e2e: float | None
    output_tokens: int
    prompt_tokens: int | None
    prompt_len: int
    chunk_times: list[float]
    chunk_tokens: list[int | None]
    token_source: str | None
    status: int | None
    error: str | None


def describe(values: Sequence[float], scale: float = 1000.0) -> dict:
    """count, mean, p50, p90, p99 and max of `values` times `scale` (1000: seconds to ms);
    None for each figure when there are no values."""
    if not values:
        return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
    out = {"count": len(values), "mean": math.fsum(values) / len(values) * scale}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(values, q) * scale
    out["max"] = max(values) * scale
    return out


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: None for a reply of one token (no gap)."""
    if output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def meets_slo(slo: SLO, ttft: float, request_tpot: float | None, e2e: float) -> bool:
    """Whether one request met every objective given (a one-token reply has no TPOT to miss)."""
    return (
        (slo.ttft is None or ttft <= slo.ttft)
        and (slo.itl is None or request_tpot is None or request_tpot <= slo.itl)
        and (slo.e2e is None or e2e <= slo.e2e)
    )


def goodput(good: int, duration: float) -> float | None:
    """Requests per second that met the SLO."""
    return good / duration if duration > 0 else None


def throughput_windows(
    events: Iterable[tuple[float, float]], start: float, end: float, width: float = 1.0
) -> list[float]:
    """Rate (amount per second) in consecutive windows [start + k*width, start + (k+1)*width)
    of `events`, (time, amount) pairs. The last window ends at `end` and may be shorter; its
    rate is over its own length. Events outside [start, end] are left out; one at `end`
    counts in the last window."""
    if not (width > 0 and end > start):
        return []
    count = math.ceil((end - start) / width)
    totals = [0.0] * count
    for t, amount in events:
        if start <= t <= end:
            totals[min(int((t - start) // width), count - 1)] += amount
    last_width = end - (start + (count - 1) * width)
    rates = [total / width for total in totals]
    rates[-1] = totals[-1] / last_width
    return rates


def token_events(record: Timed) -> list[tuple[float, float]]:
    """(time, tokens) per text chunk of a request. Where the server did not say how many tokens
    a chunk held, the request's tokens are spread evenly over its chunks."""
    times = record.chunk_times
    if not times:
        return []
    counts = record.chunk_tokens
    if len(counts) == len(times) and all(c is not None for c in counts):
        return list(zip(times, counts))
    share = record.output_tokens / len(times)
    return [(t, share) for t in times]


def failure_counts(records: Sequence[Timed]) -> list[dict]:
    """Failed requests grouped by status and reason, the most frequent first."""
    counts = Counter((r.status, r.error or "unknown") for r in records if not r.ok)
    return [
        {"status": status, "error": error, "count": n}
        for (status, error), n in sorted(counts.items(), key=lambda kv: -kv[1])
    ]


def summarize_run(records: Sequence[Timed], duration: float, slo: SLO | None = None) -> dict:
    """The report's figures for one run of `duration` seconds. Only requests that ended well
    count towards latencies, tokens and throughput."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft for r in ok]
    e2es = [r.e2e for r in ok]
    itls = [gap for r in ok for gap in r.itls]
    tpots = [t for r in ok if (t := tpot(r.e2e, r.ttft, r.output_tokens)) is not None]
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)

    def per_s(amount: float) -> float | None:
        return amount / duration if duration > 0 else None

    windows = throughput_windows((e for r in ok for e in token_events(r)), 0.0, duration)
    out = {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "peak_output_throughput": max(windows) if windows else None,
        "slo": None if slo is None else slo.to_dict(),
        "good_requests": None,
        "goodput": None,
        "ttft_ms": describe(ttfts),
        "tpot_ms": describe(tpots),
        "itl_ms": describe(itls),
        "e2e_ms": describe(e2es),
        "token_sources": dict(Counter(r.token_source for r in ok if r.token_source)),
        "errors": failure_counts(records),
    }
    if slo is not None:
        good = sum(meets_slo(slo, r.ttft, tpot(r.e2e, r.ttft, r.output_tokens), r.e2e) for r in ok)
        out["good_requests"] = good
        out["goodput"] = goodput(good, duration)
    return out
