"""What the serving console shows, kept as the steps go: the JSON behind the page.

`/metrics` holds cumulative histograms for a scraper; an operator looking at a page wants the
last minute: TTFT and ITL as two distributions (never averaged together), each step's tokens
with its measured time beside the cost model's price and the roofline's two floors, tokens/s
and what a million of them cost at the machine's price, and the last requests with what each
cost. Fed by the same step events as the Prometheus metrics (ServerMetrics.on_step), read by
`GET /console/state`. Bounded: samples older than the window, steps past the last `MAX_STEPS`,
requests past the last `MAX_REQUESTS` and series buckets older than `SERIES_S` are dropped.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

import numpy as np

from quill.contract.messages import StepStats
from quill.contract.outputs import RequestOutput

WINDOW_S = 60.0  # the distributions and rates cover this much of the past
NOW_S = 10.0  # "now": the rate over this much of the past
MAX_STEPS = 200  # steps kept for the timeline (the page draws 120)
MAX_REQUESTS = 50  # finished requests kept for the table
SERIES_BUCKET_S = 5.0  # the minutes-long series: one point per this many seconds
SERIES_S = 600.0  # ... over this much of the past
# Histogram bucket edges, seconds (TTFT and ITL alike: 1 ms to 30 s, roughly x2 apart).
BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
_EDGES = np.array(BUCKETS)


def distribution(values: Iterable[float]) -> dict:
    """Count, p50 / p90 / p99 (linear between closest ranks) and a histogram: counts per
    bucket, up to and including each edge, then above the last. In numpy: a busy minute holds
    ~10^5 inter-token gaps, and the page asks about once a second."""
    v = np.fromiter(values, dtype=np.float64)
    counts = np.bincount(np.searchsorted(_EDGES, v, side="left"), minlength=len(BUCKETS) + 1)
    p50, p90, p99 = np.percentile(v, (50, 90, 99)).tolist() if v.size else (None, None, None)
    return {
        "count": int(v.size),
        "p50": p50,
        "p90": p90,
        "p99": p99,
        "buckets": list(BUCKETS),
        "histogram": counts.tolist(),
    }


def usd_per_million(price_per_hour: float | None, seconds: float, tokens: int) -> float | None:
    """What a million output tokens cost when the machine ran `seconds` (busy or not) to make
    `tokens`: a quiet server pays for its idle time too, which is what batching buys back."""
    if price_per_hour is None or tokens <= 0:
        return None
    return price_per_hour / 3600 * seconds / tokens * 1e6


class ConsoleState:
    """The recent past of one server, as the console draws it. Times on the monotonic clock."""

    def __init__(self, started: float | None = None) -> None:
        self.started = time.monotonic() if started is None else started
        self.ttft: deque[tuple[float, float]] = deque()  # (when, seconds)
        self.itl: deque[tuple[float, float]] = deque()
        self.output_tokens: deque[tuple[float, int]] = deque()  # (when, tokens that step)
        self.steps: deque[dict] = deque(maxlen=MAX_STEPS)
        self.requests: deque[dict] = deque(maxlen=MAX_REQUESTS)
        # [bucket start, output tokens, busy seconds, steps], oldest first
        self.series: deque[list] = deque()
        self.last_stats: StepStats | None = None
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_steps = 0  # model passes seen: each step row's number

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
        bucket = self._bucket(now)
        if tokens:
            self.output_tokens.append((now, tokens))
            bucket[1] += tokens
        for out in finished:
            self._on_finished(out, now)
        if stats is not None:
            self.last_stats = stats
            self.num_preemptions += stats.num_preemptions
            if stats.num_batched_tokens:
                bucket[2] += stats.duration
                bucket[3] += 1
                self.num_steps += 1
                self.steps.append(_step_row(stats, now, self.num_steps))
        self._forget_before(now)

    def _bucket(self, now: float) -> list:
        start = self.started + (now - self.started) // SERIES_BUCKET_S * SERIES_BUCKET_S
        if not self.series or self.series[-1][0] != start:
            self.series.append([start, 0, 0.0, 0])
        return self.series[-1]

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

    def _forget_before(self, now: float) -> None:
        cutoff = now - WINDOW_S
        for samples in (self.ttft, self.itl, self.output_tokens):
            while samples and samples[0][0] < cutoff:
                samples.popleft()
        while self.series and self.series[0][0] < now - SERIES_S:
            self.series.popleft()

    def snapshot(self, now: float, price_per_hour: float | None = None) -> dict:
        """The page's view: the last minute's distributions and rates, the recent steps and
        requests, the minutes-long series (all times as seconds before `now`)."""
        self._forget_before(now)
        stats = self.last_stats
        queries = stats.prefix_cache_queries if stats else 0
        hits = stats.prefix_cache_hits if stats else 0
        # Rates over what the server has lived of each span, so a young server is not diluted.
        window = max(min(WINDOW_S, now - self.started), 1e-9)
        recent = max(min(NOW_S, now - self.started), 1e-9)
        tokens = sum(n for _, n in self.output_tokens)
        tokens_now = sum(n for t, n in self.output_tokens if t >= now - NOW_S)
        return {
            "window_s": WINDOW_S,
            "now_s": NOW_S,
            "uptime_s": now - self.started,
            "price_per_hour": price_per_hour,
            "running": stats.num_running if stats else 0,
            "waiting": stats.num_waiting if stats else 0,
            "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
            "prefix_cache_hit_rate": hits / queries if queries else None,
            "preemptions": self.num_preemptions,
            "spec_decode": _spec_decode(stats.spec_decode if stats else None),
            "finished_requests": self.num_finished,
            "ttft": distribution(v for _, v in self.ttft),
            "itl": distribution(v for _, v in self.itl),
            "output_tokens_per_s": tokens / window,
            "output_tokens_per_s_now": tokens_now / recent,
            "usd_per_million_tokens": usd_per_million(price_per_hour, window, tokens),
            "usd_per_million_tokens_now": usd_per_million(price_per_hour, recent, tokens_now),
            "series": [self._series_point(b, now, price_per_hour) for b in self.series],
            "steps": [{**s, "at": s["at"] - now} for s in self.steps],
            "requests": [
                {**r, "finished_at": r["finished_at"] - now} for r in reversed(self.requests)
            ],
        }

    def _series_point(self, bucket: list, now: float, price_per_hour: float | None) -> dict:
        start, tokens, busy, steps = bucket
        span = max(min(SERIES_BUCKET_S, now - start), 1e-9)  # the newest is still filling
        return {
            "at": start - now,
            "seconds": span,
            "output_tokens": tokens,
            "output_tokens_per_s": tokens / span,
            "busy_fraction": min(busy / span, 1.0),
            "steps": steps,
            "usd_per_million_tokens": usd_per_million(price_per_hour, span, tokens),
        }


def _step_row(stats: StepStats, now: float, number: int) -> dict:
    price = stats.price
    return {
        "step": number,
        "at": now,
        "prefill_tokens": stats.num_prefill_tokens,
        "decode_tokens": stats.num_decode_tokens,
        "measured_s": stats.duration,
        "predicted_s": price.predicted_s if price else None,
        "arithmetic_s": price.arithmetic_s if price else None,
        "movement_s": price.movement_s if price else None,
        "efficiency": price.roofline_efficiency if price else None,
        "mfu": price.mfu if price else None,
        "mbu": price.mbu if price else None,
        "cost_usd": price.cost_usd if price else None,
    }


def _spec_decode(spec) -> dict | None:
    """Speculative decoding's totals for the page (None: it is off)."""
    if spec is None:
        return None
    return {
        "drafts_allowed": spec.drafts_allowed,
        "draft_tokens": spec.num_draft_tokens,
        "accepted_tokens": spec.num_accepted_tokens,
        "acceptance_rate": spec.acceptance_rate,
        "accepted_per_position": spec.accepted_per_position,
        "mean_accepted": spec.num_accepted_tokens / spec.num_drafts if spec.num_drafts else None,
    }
