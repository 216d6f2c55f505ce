"""The arithmetic behind the experiments' numbers, kept apart from any measuring.

Each function here turns numbers into numbers (token times into gaps and stalls, a few
measured step times into the time of a whole reply, seconds per token into dollars per million
tokens), so the tests check them by hand without a model or a clock.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from quill.sim.metrics import percentile


def percentile_or_none(values: Sequence[float], q: float) -> float | None:
    """The shared `percentile` (quill/sim/metrics.py), or None for no values."""
    return percentile(values, q) if len(values) else None


def median(values: Sequence[float]) -> float | None:
    return percentile_or_none(values, 50)


def gaps(times: Sequence[float]) -> list[float]:
    """The waits between consecutive tokens of one stream."""
    return [b - a for a, b in zip(times, times[1:])]


def gap_stats(
    token_times: Mapping[str, Sequence[float]],
    streams: Sequence[str],
    arrival: float,
    first_token: float | None,
) -> dict:
    """How the streams fared around a newcomer that arrived at `arrival`.

    Over every gap of the given streams: p50, p99 and the longest (the longest stall); the
    median of the gaps that ended before the arrival, of those that ended after it (the ones
    it could touch), and of those after the newcomer's first token (when it decodes beside
    them). `ttft_s` is the newcomer's wait from its arrival to its first token (None if it
    never got one).
    """
    every, before, after, joined = [], [], [], []
    for rid in streams:
        for end, gap in zip(token_times[rid][1:], gaps(token_times[rid])):
            every.append(gap)
            (after if end > arrival else before).append(gap)
            if first_token is not None and end > first_token:
                joined.append(gap)
    return {
        "num_gaps": len(every),
        "p50_s": percentile_or_none(every, 50),
        "p99_s": percentile_or_none(every, 99),
        "longest_stall_s": max(every) if every else None,
        "before_arrival_p50_s": percentile_or_none(before, 50),
        "after_arrival_p50_s": percentile_or_none(after, 50),
        "after_first_token_p50_s": percentile_or_none(joined, 50),
        "ttft_s": None if first_token is None else first_token - arrival,
    }


def interpolate(points: Sequence[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through (x, y) points sorted by x, extended along the end segments."""
    if len(points) == 1:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1 or (x1, y1) == points[-1]:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    raise AssertionError("unreachable")


def integrate_steps(points: Sequence[tuple[float, float]], start: int, count: int) -> float:
    """The summed time of `count` decode steps at contexts start, start+1, ...: each step's
    time read off the line through (context, seconds) points measured at a few contexts."""
    ordered = sorted(points)
    if not ordered:
        raise ValueError("no measured steps to integrate")
    return math.fsum(interpolate(ordered, start + k) for k in range(count))


def per_million(seconds_per_token: float, price_per_hour: float) -> dict:
    """Seconds, hours and dollars per million tokens at a given price per machine-hour."""
    seconds = seconds_per_token * 1e6
    return {
        "seconds_per_million": seconds,
        "hours_per_million": seconds / 3600,
        "usd_per_million": seconds / 3600 * price_per_hour,
    }


def relative_error(predicted: float | None, measured: float | None) -> float | None:
    """(predicted - measured) / measured: positive when the prediction is too slow."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured
