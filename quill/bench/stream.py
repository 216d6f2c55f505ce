"""One streamed request, timed as its reader sees it, from any OpenAI-compatible server.

A serving benchmark is only as good as its stopwatch: this is where each chunk gets its arrival
time, where the tokens a chunk carries are counted (servers say so in different ways), and
where every way a request can go wrong (refused connection, error status, error event, a
stream cut short, a timeout) becomes a failure with its reason instead of an exception, so
that one bad request never stops a run.

Tokens are counted from the best source the server gives: `usage` (in the last chunk, or in
every chunk with vLLM's `continuous_usage_stats`), else one logprob entry per token or
llama-server's running `timings.predicted_n`, else by tokenizing the text that arrived.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import httpx

ENDPOINT_PATHS = {
    "completions": "/v1/completions",
    "chat": "/v1/chat/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
}
# The events that end a Responses API or Messages API stream (they send no [DONE]).
END_EVENTS = {"response.completed", "response.incomplete", "response.failed", "message_stop"}


class StreamFailure(Exception):
    """A request that did not end well; `status` is the HTTP status when one came back."""

    def __init__(self, reason: str, status: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


@dataclass
class StreamRecord:
    """What the client saw of one request. Times are seconds on the run's clock."""

    index: int
    prompt_len: int  # the prompt's tokens as the client's tokenizer counts them
    max_tokens: int
    scheduled: float  # when the arrival process said to send it
    sent: float | None = None  # when it left (later than scheduled when concurrency is capped)
    ended: float | None = None  # [DONE], or the moment it failed
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried output text
    chunk_tokens: list[int | None] = field(default_factory=list)  # their tokens, if told
    prompt_tokens: int | None = None  # the server's count, from usage
    output_tokens: int = 0
    token_source: str | None = None  # usage | logprobs | timings | tokenizer
    status: int | None = None
    error: str | None = None
    text: str = ""
    # The server's own TTFT (from its arrival there), where it reports one (quill's last chunk:
    # `metrics.time_to_first_token`): the client's minus it is the way in and out.
    server_ttft: float | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.ended is not None and bool(self.chunk_times)

    @property
    def ttft(self) -> float | None:
        if not self.chunk_times or self.sent is None:
            return None
        return self.chunk_times[0] - self.sent

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times
        return [b - a for a, b in zip(times, times[1:])]

    @property
    def e2e(self) -> float | None:
        if self.sent is None or self.ended is None:
            return None
        return self.ended - self.sent


def count_new_tokens(chunk: dict, counted: int) -> int:
    """Tokens a streamed chunk brings: one logprob entry per token (completions' `tokens`,
    chat's `content`), or llama-server's running count (`timings.predicted_n`). (A chunk's
    `usage` is read before this, in `_stream`.)"""
    timings = chunk.get("timings")
    if timings and "predicted_n" in timings:
        return max(timings["predicted_n"] - counted, 0)
    total = 0
    for choice in chunk.get("choices") or []:
        logprobs = choice.get("logprobs") or {}
        total += len(logprobs.get("tokens") or logprobs.get("content") or [])
    return total


def error_message(payload: object) -> str:
    """The message of an OpenAI-style error body ({"error": {"message": ...}}), or the body."""
    if isinstance(payload, dict):
        inner = payload.get("error", payload)
        if isinstance(inner, dict) and isinstance(inner.get("message"), str):
            return inner["message"]
        if isinstance(inner, str):
            return inner
    return json.dumps(payload)[:500]


async def sse_chunks(
    response: httpx.Response, clock: Callable[[], float] = time.perf_counter
) -> AsyncIterator[tuple[float, dict | None]]:
    """(arrival time, chunk) for every data event, then (time, None) for [DONE] (or after the
    event that ends a Responses or Messages stream).

    Raises StreamFailure for an error event, an event that is not JSON, or a stream that ends
    without [DONE] (a server that died mid-reply).
    """
    event = ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
            continue
        if not line.startswith("data:"):
            if not line:
                event = ""  # a blank line ends an event
            continue
        now = clock()
        data = line[5:].strip()
        if data == "[DONE]":
            yield now, None
            return
        try:
            chunk = json.loads(data)
        except ValueError:
            raise StreamFailure(f"unreadable event: {data[:200]}") from None
        if event == "error" or not isinstance(chunk, dict) or "error" in chunk:
            raise StreamFailure(f"error event: {error_message(chunk)}")
        yield now, chunk
        if chunk.get("type") in END_EVENTS:
            if chunk["type"] == "response.failed":
                raise StreamFailure(f"error event: {error_message(chunk['response'])}")
            yield now, None
            return
    raise StreamFailure("stream ended without [DONE]")


def chunk_text(chunk: dict) -> str:
    """The output text of a completions or chat chunk (first choice: one is asked for), or of
    a Responses or Messages API event."""
    kind = chunk.get("type")
    if kind in ("response.output_text.delta", "response.reasoning_text.delta",
                "response.function_call_arguments.delta"):  # fmt: skip
        return chunk.get("delta") or ""
    if kind == "content_block_delta":
        delta = chunk.get("delta") or {}
        return delta.get("text") or delta.get("thinking") or delta.get("partial_json") or ""
    choices = chunk.get("choices") or []
    if not choices:
        return ""
    choice = choices[0]
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    # A reasoning model's thinking is output too (vLLM streams it apart from the content).
    return delta.get("content") or delta.get("reasoning_content") or ""


def openai_usage(chunk: dict) -> dict | None:
    """A chunk's usage as chat completions name it (prompt_tokens, completion_tokens): the
    Responses API gives it in its last event, the Messages API in message_start (the prompt)
    and message_delta (the output)."""
    kind = chunk.get("type")
    if kind in ("response.completed", "response.incomplete"):
        u = (chunk.get("response") or {}).get("usage") or {}
        return {"prompt_tokens": u.get("input_tokens"), "completion_tokens": u.get("output_tokens")}
    if kind in ("message_start", "message_delta"):
        u = (chunk.get("message") or chunk).get("usage") or {}
        prompt = None
        if u.get("input_tokens") is not None:
            prompt = u["input_tokens"] + (u.get("cache_read_input_tokens") or 0)
        output = u.get("output_tokens") if kind == "message_delta" else None
        return {"prompt_tokens": prompt, "completion_tokens": output}
    return chunk.get("usage")


async def stream_request(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    record: StreamRecord,
    clock: Callable[[], float] = time.perf_counter,
    count_text: Callable[[str], int] | None = None,
    timeout: float | None = None,
) -> None:
    """POST `body` to `path`, streaming the reply into `record`; never raises for a bad reply.

    `timeout` bounds the whole request (connect to [DONE]); `count_text` counts the reply's
    tokens when the server says nothing about them.
    """
    record.sent = clock()
    try:
        async with asyncio.timeout(timeout):
            await _stream(client, path, body, record, clock)
        if not record.chunk_times:
            raise StreamFailure("the reply carried no text")
    except StreamFailure as e:
        record.error, record.status = e.reason, e.status or record.status
    except TimeoutError:
        record.error = f"timed out after {timeout:g} s"
    except httpx.TimeoutException as e:
        record.error = f"timed out ({type(e).__name__})"
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"
    finally:
        if record.ended is None:
            record.ended = clock()
    if record.token_source is None and count_text is not None and record.text:
        record.output_tokens = count_text(record.text)
        record.token_source = "tokenizer"


async def _stream(
    client: httpx.AsyncClient,
    path: str,
    body: dict,
    record: StreamRecord,
    clock: Callable[[], float],
) -> None:
    async with client.stream("POST", path, json=body) as response:
        record.status = response.status_code
        if response.status_code != 200:
            raw = (await response.aread()).decode(errors="replace")
            try:
                message = error_message(json.loads(raw))
            except ValueError:
                message = raw[:500]
            raise StreamFailure(f"HTTP {response.status_code}: {message}", response.status_code)
        usage_tokens: int | None = None  # completion tokens the last usage said
        counted = 0  # tokens counted from logprobs or timings
        counted_from: str | None = None
        async for now, chunk in sse_chunks(response, clock):
            if chunk is None:
                record.ended = now
                break
            text = chunk_text(chunk)
            metrics = chunk.get("metrics")
            if isinstance(metrics, dict) and metrics.get("time_to_first_token") is not None:
                record.server_ttft = float(metrics["time_to_first_token"])
            tokens: int | None = None
            usage = openai_usage(chunk)
            if usage and usage.get("prompt_tokens") is not None:
                record.prompt_tokens = usage["prompt_tokens"]
            if usage and usage.get("completion_tokens") is not None:
                tokens = usage["completion_tokens"] - (usage_tokens or 0)
                usage_tokens = usage["completion_tokens"]
            elif usage_tokens is None:
                new = count_new_tokens(chunk, counted)
                if new:
                    counted += new
                    counted_from = "timings" if "timings" in chunk else "logprobs"
                    tokens = new
            # Tokens a text-less chunk announces (a final usage chunk, llama-server's last
            # timings) belong to no timed chunk: they count in the total only.
            if text:
                record.text += text
                record.chunk_times.append(now)
                record.chunk_tokens.append(tokens)
    if usage_tokens is not None:
        record.output_tokens, record.token_source = usage_tokens, "usage"
    elif counted_from is not None:
        record.output_tokens, record.token_source = counted, counted_from
