"""What the serving console shows (issue 23), kept as the steps go: the JSON behind the page.

`/metrics` holds cumulative histograms for a scraper; an operator looking at a page wants the
last minute: TTFT and ITL as two distributions (never averaged together), each step's tokens
with its measured time beside the cost model's price, tokens/s, and the last requests with what
each cost. Fed by the same step events as the Prometheus metrics (ServerMetrics.on_step), read
by `GET /console/state`. Bounded: samples older than the window, and requests past the last
`MAX_REQUESTS`, are dropped.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from quill.contract.messages import StepStats
from quill.contract.outputs import RequestOutput

WINDOW_S = 60.0  # the distributions and rates cover this much of the past
MAX_STEPS = 600  # steps kept for the timeline
MAX_REQUESTS = 50  # finished requests kept for the table
# Histogram bucket edges, seconds (TTFT and ITL alike: 1 ms to 30 s, roughly x2 apart).
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)


def percentile(sorted_values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not sorted_values:
        return None
    pos = (len(sorted_values) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (pos - low)


def distribution(values: Iterable[float]) -> dict:
    """Count, p50 / p90 / p99 and a histogram (counts per bucket: up to each edge, then above)."""
    ordered = sorted(values)
    counts = [0] * (len(BUCKETS) + 1)
    for v in ordered:
        counts[next((i for i, edge in enumerate(BUCKETS) if v <= edge), len(BUCKETS))] += 1
    return {
        "count": len(ordered),
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "buckets": list(BUCKETS),
        "histogram": counts,
    }


class ConsoleState:
    """The recent past of one server, as the console draws it. Times on the monotonic clock."""

    def __init__(self) -> None:
        self.ttft: deque[tuple[float, float]] = deque()  # (when, seconds)
        self.itl: deque[tuple[float, float]] = deque()
        self.output_tokens: deque[tuple[float, int]] = deque()  # (when, tokens that step)
        self.steps: deque[dict] = deque(maxlen=MAX_STEPS)
        self.requests: deque[dict] = deque(maxlen=MAX_REQUESTS)
        self.last_stats: StepStats | None = None
        self.num_preemptions = 0
        self.num_finished = 0

    def on_step(
        self,
        stats: StepStats | None,
        now: float,
        gaps: Iterable[float],
        tokens: int,
        finished: Iterable[RequestOutput],
    ) -> None:
        """One step as ServerMetrics saw it: its inter-token gaps, the tokens it produced, the
        requests it finished."""
        self.itl.extend((now, gap) for gap in gaps)
        if tokens:
            self.output_tokens.append((now, tokens))
        for out in finished:
            self._on_finished(out, now)
        if stats is not None:
            self.last_stats = stats
            self.num_preemptions += stats.num_preemptions
            if stats.num_batched_tokens:
                price = stats.price
                self.steps.append(
                    {
                        "at": now,
                        "prefill_tokens": stats.num_prefill_tokens,
                        "decode_tokens": stats.num_decode_tokens,
                        "measured_s": stats.duration,
                        "predicted_s": price.predicted_s if price else None,
                        "efficiency": price.roofline_efficiency if price else None,
                        "mfu": price.mfu if price else None,
                        "mbu": price.mbu if price else None,
                    }
                )
        self._forget_before(now - WINDOW_S)

    def _on_finished(self, out: RequestOutput, now: float) -> None:
        m = out.metrics
        self.num_finished += 1
        if m.time_to_first_token is not None:
            self.ttft.append((now, m.time_to_first_token))
        self.requests.append(
            {
                "request_id": out.request_id,
                "finished_at": now,
                "finish_reason": out.outputs[0].finish_reason or "abort",
                "prompt_tokens": m.num_prompt_tokens,
                "output_tokens": m.num_generation_tokens,
                "cached_tokens": m.num_cached_tokens,
                "ttft_s": m.time_to_first_token,
                "mean_itl_s": m.mean_inter_token_latency,
                "e2e_s": m.e2e_latency,
                "flops": m.flops,
                "bytes": m.bytes_moved,
                "cost_usd": m.cost_usd,
            }
        )

    def _forget_before(self, cutoff: float) -> None:
        for samples in (self.ttft, self.itl, self.output_tokens):
            while samples and samples[0][0] < cutoff:
                samples.popleft()

    def snapshot(self, now: float) -> dict:
        """The page's view: the last minute's distributions and rate, the recent steps and
        requests (their times as seconds before `now`)."""
        self._forget_before(now - WINDOW_S)
        stats = self.last_stats
        queries = stats.prefix_cache_queries if stats else 0
        hits = stats.prefix_cache_hits if stats else 0
        tokens = sum(n for _, n in self.output_tokens)
        return {
            "window_s": WINDOW_S,
            "running": stats.num_running if stats else 0,
            "waiting": stats.num_waiting if stats else 0,
            "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "preemptions": self.num_preemptions,
            "finished_requests": self.num_finished,
            "ttft": distribution(v for _, v in self.ttft),
            "itl": distribution(v for _, v in self.itl),
            "output_tokens_per_s": tokens / WINDOW_S,
            "steps": [{**s, "at": s["at"] - now} for s in self.steps],
            "requests": [
                {**r, "finished_at": r["finished_at"] - now} for r in reversed(self.requests)
            ],
        }
