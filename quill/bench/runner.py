"""Send a benchmark's requests at their arrival times, at most N in flight, and time them.

An open loop: each request leaves at its arrival offset whatever the server is doing, so a
slow server builds a queue instead of slowing the client down. With a concurrency cap, a
request due while N are in flight waits here, in the client, and its clock starts only when it
is sent: TTFT then measures the server, not the cap.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx

from quill.bench.datasets import BenchRequest
from quill.bench.stream import ENDPOINT_PATHS, StreamRecord, error_message, stream_request


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are asked."""

    base_url: str
    model: str
    endpoint: str = "completions"  # or "chat", "responses", "messages"
    api_key: str | None = None
    ignore_eos: bool = False
    timeout: float = 600.0
    max_concurrency: int | None = None
    extra_body: dict | None = None  # fields every request adds (or overrides)

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def request_body(target: Target, request: BenchRequest) -> dict:
    """A streamed request asking for usage in every chunk (vLLM's and quill's extension; other
    servers ignore it and send usage last, or not at all), greedy so runs compare."""
    body: dict = {"model": target.model}
    asked = [{"role": "user", "content": request.prompt}]
    if target.endpoint == "responses":  # usage comes in its last event
        body |= {"input": asked, "max_output_tokens": request.output_len}
    elif target.endpoint == "messages":  # usage in message_start and message_delta
        body |= {"messages": asked, "max_tokens": request.output_len}
    else:
        if target.endpoint == "chat":
            body["messages"] = asked
        else:
            body["prompt"] = request.prompt
        usage = {"include_usage": True, "continuous_usage_stats": True}
        body |= {"max_tokens": request.output_len, "stream_options": usage}
    body |= {"temperature": 0, "stream": True}
    if target.ignore_eos:
        body["ignore_eos"] = True
    return body | (target.extra_body or {})


async def first_model(base_url: str, api_key: str | None = None, timeout: float = 30.0) -> str:
    """The first model id the server lists at GET /v1/models."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=timeout) as client:
        try:
            response = await client.get("/v1/models")
        except httpx.HTTPError as e:
            raise ValueError(f"could not list the models at {base_url}: {e!r}") from None
        try:
            payload = response.json()
        except ValueError:
            payload = response.text
        if response.status_code != 200:
            raise ValueError(
                f"GET {base_url}/v1/models: HTTP {response.status_code}: {error_message(payload)}"
            )
        try:
            return payload["data"][0]["id"]
        except (KeyError, IndexError, TypeError):
            raise ValueError(f"GET {base_url}/v1/models listed no model") from None


async def run_requests(
    target: Target,
    requests: Sequence[BenchRequest],
    offsets: Sequence[float],
    count_text: Callable[[str], int] | None = None,
    on_done: Callable[[StreamRecord], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[StreamRecord], float]:
    """Send every request at its offset (seconds from now); returns one record per request,
    times in seconds from the start, and the run's duration (until the last one ended).
    `transport` replaces the network (tests use httpx.MockTransport)."""
    records = [
        StreamRecord(i, r.prompt_len, r.output_len, offset)
        for i, (r, offset) in enumerate(zip(requests, offsets, strict=True))
    ]
    bodies = [request_body(target, r) for r in requests]
    cap = target.max_concurrency
    gate = asyncio.Semaphore(cap) if cap else None
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    path = ENDPOINT_PATHS[target.endpoint]
    start = 0.0  # set when everything is ready, so that setting up costs no request time

    def clock() -> float:
        return time.perf_counter() - start

    async def one(record: StreamRecord, body: dict) -> None:
        delay = record.scheduled - clock()
        if delay > 0:
            await asyncio.sleep(delay)
        if gate is None:
            await stream_request(client, path, body, record, clock, count_text, target.timeout)
        else:
            async with gate:
                await stream_request(client, path, body, record, clock, count_text, target.timeout)
        if on_done is not None:
            on_done(record)

    async with httpx.AsyncClient(
        base_url=target.base_url,
        headers=target.headers,
        timeout=httpx.Timeout(target.timeout),
        limits=limits,
        transport=transport,
    ) as client:
        tasks = [one(record, body) for record, body in zip(records, bodies)]
        start = time.perf_counter()
        await asyncio.gather(*tasks)
    ends = [r.ended for r in records if r.ended is not None]
    return records, max(ends, default=0.0)
