"""A streaming load client: send a workload to an OpenAI-compatible server at its arrival times.

Measuring serving means timestamping what a user sees: when each request left, when its first
token arrived, and the gap before every later one. This client sends each request of a
workload (the simulator's `WorkItem`s: arrival time, prompt and reply lengths) at its arrival
time whatever the server is doing (an open loop, so a slow server builds a queue rather than
slowing the client down), streams the reply and timestamps every chunk on arrival. It asks for
one logprob per token so every token arrives as a chunk of its own, even one whose text is
held back. Failures (refused connections, error statuses, dropped streams) are kept with their
reasons, and the run goes on. `quill bench serve` (quill.bench.serve) is the full benchmark;
this keeps the per-token records the scripts under benchmarks/ compare with the simulator.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from quill.bench.stream import StreamFailure, count_new_tokens, sse_chunks
from quill.sim.metrics import Distribution
from quill.sim.workload import WorkItem


@dataclass
class RequestRecord:
    """What the client saw of one request (times in seconds of the client's monotonic clock)."""

    request_id: str
    prompt_tokens: int
    max_tokens: int
    scheduled: float  # when the workload said it arrives
    sent: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # one per token-bearing chunk
    output_tokens: int = 0
    finished: float | None = None
    error: str | None = None
    server_metrics: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.finished is not None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.sent if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        t = self.chunk_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.sent


def random_prompt(num_tokens: int, rng: random.Random, vocab: Sequence[int]) -> list[int]:
    """Token ids drawn at random, so no two prompts share a prefix a cache could reuse."""
    return [rng.choice(vocab) for _ in range(num_tokens)]


async def _one(
    client: httpx.AsyncClient,
    record: RequestRecord,
    body: dict,
    start: float,
) -> None:
    delay = start + record.scheduled - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)
    await stream_completion(client, record, body)


async def stream_completion(client: httpx.AsyncClient, record: RequestRecord, body: dict) -> None:
    """One streamed completion into `record`, every token timestamped as its chunk arrives."""
    record.sent = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for now, chunk in sse_chunks(response, time.monotonic):
                if chunk is None:
                    record.finished = now
                    break
                new_tokens = count_new_tokens(chunk, record.output_tokens)
                record.chunk_times.extend([now] * new_tokens)
                record.output_tokens += new_tokens
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
                if "metrics" in chunk:
                    record.server_metrics = chunk["metrics"]
    except StreamFailure as e:
        record.error = e.reason
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"


async def run_workload(
    base_url: str,
    model: str,
    items: Sequence[WorkItem],
    make_prompt: Callable[[WorkItem], list[int] | str],
    api_key: str | None = None,
    timeout: float = 600.0,
    extra_body: dict | None = None,
) -> list[RequestRecord]:
    """Send every item at its arrival time (seconds from now); returns one record per item."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    records, bodies = [], []
    for item in items:
        records.append(
            RequestRecord(
                item.request_id, item.prompt_tokens, item.output_tokens, item.arrival_time
            )
        )
        bodies.append(
            {
                "model": model,
                "prompt": make_prompt(item),
                "max_tokens": item.output_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "logprobs": 0,
                "stream": True,
                **(extra_body or {}),
            }
        )
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=timeout, limits=limits
    ) as client:
        start = time.monotonic()
        await asyncio.gather(*(_one(client, r, b, start) for r, b in zip(records, bodies)))
    return records


def summarize(records: Sequence[RequestRecord]) -> dict:
    """TTFT, inter-token latency (over all gaps), end-to-end latency in ms, and throughput."""
    ttft, itl, e2e = Distribution(), Distribution(), Distribution()
    ok = [r for r in records if r.ok]
    for r in ok:
        ttft.add(r.ttft)
        e2e.add(r.e2e)
        for gap in r.itls:
            itl.add(gap)
    if ok:
        duration = max(r.finished for r in ok) - min(r.sent for r in ok)
    else:
        duration = 0.0
    output = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "output_tokens": output,
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput": output / duration if duration else None,
        "ttft_ms": ttft.summary(1000),
        "itl_ms": itl.summary(1000),
        "e2e_ms": e2e.summary(1000),
    }
