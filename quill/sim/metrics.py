"""What a benchmark client would measure, gathered from the engine's own request timestamps.

A simulation of 100,000 requests sees millions of inter-token gaps, but in virtual time most of
them are the same few step durations, so every distribution here is a value -> count map: exact
percentiles in little memory. Percentiles interpolate linearly between ranks, as numpy's
default does, so the figures compare with vLLM's benchmark client.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from quill.engine.request import Request

PERCENTILES = (50, 90, 99)


class Distribution:
    """Values with multiplicities; `add` is the hot path (once per request or per token)."""

    __slots__ = ("counts",)

    def __init__(self) -> None:
        self.counts: dict[float, int] = {}

    def add(self, value: float) -> None:
        counts = self.counts
        counts[value] = counts.get(value, 0) + 1

    @property
    def count(self) -> int:
        return sum(self.counts.values())

    def summary(self, scale: float = 1.0) -> dict:
        """count, mean, p50, p90, p99 and max, each value multiplied by `scale` (1000: ms)."""
        items = sorted(self.counts.items())
        n = sum(c for _, c in items)
        if n == 0:
            return {"count": 0, "mean": None, **{f"p{q}": None for q in PERCENTILES}, "max": None}
        values = [v for v, _ in items]
        cumulative = []
        running = 0
        for _, c in items:
            running += c
            cumulative.append(running)
        out = {"count": n, "mean": math.fsum(v * c for v, c in items) / n * scale}
        for q in PERCENTILES:
            out[f"p{q}"] = weighted_percentile(values, cumulative, q) * scale
        out["max"] = values[-1] * scale
        return out


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values`, linearly interpolated between ranks (numpy's
    default): with the values sorted as x[0..n-1] and h = (n - 1) * q / 100, it is
    x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)]). The one definition the
    benchmark client, the experiments and the simulator share."""
    if len(values) == 0:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be within 0..100, got {q}")
    return weighted_percentile(sorted(values), range(1, len(values) + 1), q)


def weighted_percentile(values: Sequence[float], cumulative: Sequence[int], q: float) -> float:
    """`percentile` of sorted distinct `values` where value i occurs up to cumulative count
    `cumulative[i]` (a value -> count map, as the simulator keeps its distributions)."""
    h = (cumulative[-1] - 1) * q / 100

    def at(rank: int) -> float:
        return values[bisect_right(cumulative, rank)]

    low = math.floor(h)
    a = at(low)
    frac = h - low
    return a if frac == 0 else a + frac * (at(low + 1) - a)


@dataclass(frozen=True)
class SLO:
    """Latency objectives in seconds; None means not asked for."""

    ttft: float | None = None
    itl: float | None = None
    e2e: float | None = None

    @classmethod
    def parse(cls, text: str) -> SLO:
        """'ttft=MS,itl=MS[,e2e=MS]' (milliseconds)."""
        values: dict[str, float] = {}
        for part in str(text).split(","):
            key, sep, value = part.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "itl", "e2e"):
                raise ValueError(f"expected ttft=MS,itl=MS[,e2e=MS], got {text!r}")
            if key in values:
                raise ValueError(f"{key} given twice in {text!r}")
            try:
                ms = float(value)
            except ValueError:
                raise ValueError(f"{key}={value!r} is not a number of milliseconds") from None
            if not (ms > 0 and math.isfinite(ms)):
                raise ValueError(f"{key} must be a positive number of milliseconds, got {value!r}")
            values[key] = ms / 1000
        return cls(**values)

    def to_dict(self) -> dict:
        return {f"{k}_ms": None if v is None else v * 1000 for k, v in self.limits().items()}

    def limits(self) -> dict[str, float | None]:
        return {"ttft": self.ttft, "itl": self.itl, "e2e": self.e2e}

    def meets_percentile(self, results: dict, q: int = 99) -> bool:
        """Whether the q-th percentile TTFT, ITL (over all gaps) and end-to-end latency of a
        run's results are within the objectives given."""
        for key, limit in self.limits().items():
            if limit is None:
                continue
            value = results[f"{key}_ms"][f"p{q}"]
            if value is not None and value > limit * 1000:
                return False
        return True


class MetricsSink:
    """Takes every finished request and keeps only its figures.

    `itl` is filled token by token by the requests' timestamps (`RequestTimes.itl_counts`); the
    rest are filled here when a request ends. A request is good (counts towards goodput) when
    it got its whole reply, its TTFT and end-to-end latency are within the SLO, and its mean
    inter-token latency (its time per output token) is too.
    """

    def __init__(self, slo: SLO | None = None, front_latency_s: float = 0.0) -> None:
        """`front_latency_s`: added to every TTFT and end-to-end latency (SimConfig's)."""
        self.slo = slo
        self.front_latency_s = front_latency_s
        self.ttft = Distribution()
        self.itl = Distribution()
        self.tpot = Distribution()
        self.e2e = Distribution()
        self.queue = Distribution()
        self.num_requests = 0
        self.num_good = 0
        self.num_truncated = 0
        self.num_preemptions = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        self.first_arrival = math.inf
        self.last_finish = -math.inf

    def record(self, request: Request, extra_preemptions: int = 0) -> None:
        times = request.times
        arrival = times.arrival
        num_out = len(request.output_token_ids)
        self.num_requests += 1
        self.prompt_tokens += len(request.prompt_token_ids)
        self.output_tokens += num_out
        self.num_preemptions += request.num_preemptions + extra_preemptions
        self.first_arrival = min(self.first_arrival, arrival)
        self.last_finish = max(self.last_finish, times.finished)
        if times.first_token is None:  # ended before its first token
            self.num_truncated += 1
            return
        ttft = times.first_token - arrival + self.front_latency_s
        e2e = times.finished - arrival + self.front_latency_s
        self.ttft.add(ttft)
        self.e2e.add(e2e)
        self.queue.add(times.first_scheduled - arrival)
        tpot = None
        if num_out > 1:
            tpot = (times.last_token - times.first_token) / (num_out - 1)
            self.tpot.add(tpot)
        truncated = num_out < request.max_tokens
        self.num_truncated += truncated
        slo = self.slo
        if slo is not None and not truncated:
            good = (
                (slo.ttft is None or ttft <= slo.ttft)
                and (slo.itl is None or tpot is None or tpot <= slo.itl)
                and (slo.e2e is None or e2e <= slo.e2e)
            )
            self.num_good += good

    @property
    def duration(self) -> float:
        """From the first arrival to the last reply's end, like a benchmark client's wall time."""
        return max(self.last_finish - self.first_arrival, 0.0) if self.num_requests else 0.0

    def results(self) -> dict:
        duration = self.duration

        def per_s(x: float) -> float | None:
            return x / duration if duration > 0 else None

        out = {
            "num_requests": self.num_requests,
            "num_truncated": self.num_truncated,
            "num_preemptions": self.num_preemptions,
            "duration_s": duration,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "request_throughput": per_s(self.num_requests),
            "output_throughput": per_s(self.output_tokens),
            "total_token_throughput": per_s(self.prompt_tokens + self.output_tokens),
            "goodput": per_s(self.num_good) if self.slo is not None else None,
            "num_good": self.num_good if self.slo is not None else None,
        }
        for name in ("ttft", "itl", "tpot", "e2e", "queue"):
            out[f"{name}_ms"] = getattr(self, name).summary(1000.0)
        return out
