"""The benchmark client against fake servers: token counting (usage, one logprob entry per
token, llama-server's running count, the tokenizer), chunk timing, every kind of failure kept
with its reason, and the run's arrival times and concurrency cap."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from quill.bench.client import token_gaps
from quill.bench.datasets import BenchRequest
from quill.bench.runner import Target, run_requests
from quill.bench.stream import StreamRecord, count_new_tokens, stream_request


def test_counts_logprob_entries_per_chunk():
    chunk = {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}
    assert count_new_tokens(chunk, counted=5) == 2
    assert count_new_tokens({"choices": [{"text": "", "logprobs": None}]}, counted=0) == 0
    assert count_new_tokens({"choices": [], "usage": {"completion_tokens": 9}}, counted=9) == 0


def test_counts_llama_server_running_total():
    # llama-server sends no logprobs by default; its timings carry the tokens predicted so far.
    assert count_new_tokens({"choices": [{}], "timings": {"predicted_n": 7}}, counted=5) == 2
    assert count_new_tokens({"timings": {"predicted_n": 3}}, counted=3) == 0


# -- streaming one request (quill.bench.stream) ---------------------------------------------
class Ticks:
    """A clock that reads the given times in turn: one read when the request is sent, one per
    data event as it arrives, one more when a request fails before [DONE]."""

    def __init__(self, *times: float) -> None:
        self.times = list(times)

    def __call__(self) -> float:
        return self.times.pop(0)


def _sse(*events: dict | str) -> bytes:
    lines = [f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n" for e in events]
    return "".join(lines).encode()


def _stream(reply, body: dict | None = None, path: str = "/v1/completions", **kwargs):
    """Run stream_request against a fake server whose reply is `reply(request)`."""
    seen = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return reply(request)

    async def go() -> StreamRecord:
        record = StreamRecord(0, prompt_len=5, max_tokens=3, scheduled=0.0)
        transport = httpx.MockTransport(handler)
        async with httpx.AsyncClient(base_url="http://test", transport=transport) as client:
            await stream_request(client, path, body or {"prompt": "x"}, record, **kwargs)
        return record

    return asyncio.run(go()), seen


def test_stream_times_text_chunks_and_counts_tokens_from_continuous_usage():
    def usage(n: int) -> dict:
        return {"prompt_tokens": 5, "completion_tokens": n, "total_tokens": 5 + n}

    body = _sse(
        {"choices": [{"text": "Hel"}], "usage": usage(1)},
        {"choices": [{"text": "lo!"}], "usage": usage(3)},  # two tokens in one chunk
        {"choices": [{"text": "", "finish_reason": "length"}], "usage": usage(3)},
        {"choices": [], "usage": usage(3)},
        "[DONE]",
    )
    clock = Ticks(10.0, 10.4, 10.5, 10.7, 10.8, 11.0)
    record, seen = _stream(lambda _: httpx.Response(200, content=body), clock=clock)
    assert record.ok and record.error is None and record.status == 200
    assert record.chunk_times == [10.4, 10.5]  # only chunks with text
    assert record.chunk_tokens == [1, 2]
    assert record.ttft == pytest.approx(0.4)  # 10.4 - 10.0
    assert record.itls == pytest.approx([0.1])  # one gap per chunk, not per token
    assert record.e2e == pytest.approx(1.0)  # to [DONE]
    assert (record.output_tokens, record.token_source, record.prompt_tokens) == (3, "usage", 5)
    assert record.text == "Hello!"
    assert seen[0].url.path == "/v1/completions"


def test_chat_stream_role_chunk_is_no_token_and_usage_may_come_last():
    body = _sse(
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hi"}}]},
        {"choices": [{"delta": {"content": " there"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 2}},
        "[DONE]",
    )
    clock = Ticks(0.0, 0.1, 0.3, 0.4, 0.45, 0.5)
    record, _ = _stream(lambda _: httpx.Response(200, content=body), clock=clock)
    assert record.chunk_times == [0.3, 0.4]  # the role chunk at 0.1 carried no text
    assert record.ttft == pytest.approx(0.3)
    assert record.chunk_tokens == [None, None]  # the server did not say per chunk
    assert (record.output_tokens, record.token_source, record.prompt_tokens) == (2, "usage", 9)


def test_without_usage_tokens_come_from_logprobs_timings_or_the_tokenizer():
    logprobs = _sse(
        {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]},
        {"choices": [{"text": "c", "logprobs": {"tokens": ["c"]}}]},
        "[DONE]",
    )
    record, _ = _stream(lambda _: httpx.Response(200, content=logprobs))
    assert (record.output_tokens, record.token_source, record.chunk_tokens) == (
        3,
        "logprobs",
        [2, 1],
    )

    llama = _sse(
        {"choices": [{"text": "one"}]},
        {"choices": [{"text": " two"}]},
        {"choices": [{"text": "", "finish_reason": "length"}], "timings": {"predicted_n": 4}},
        "[DONE]",
    )
    record, _ = _stream(lambda _: httpx.Response(200, content=llama))
    assert (record.output_tokens, record.token_source) == (4, "timings")

    plain = _sse({"choices": [{"text": "one"}]}, {"choices": [{"text": " two three"}]}, "[DONE]")
    words = lambda text: len(text.split())  # noqa: E731
    record, _ = _stream(lambda _: httpx.Response(200, content=plain), count_text=words)
    assert (record.output_tokens, record.token_source) == (3, "tokenizer")


def test_error_status_keeps_the_status_and_message():
    error = {"error": {"message": "The model `x` does not exist.", "type": "invalid_request_error"}}
    record, _ = _stream(lambda _: httpx.Response(404, json=error), clock=Ticks(1.0, 1.25))
    assert not record.ok
    assert record.status == 404
    assert record.error == "HTTP 404: The model `x` does not exist."
    assert record.ended == 1.25 and record.ttft is None
    record, _ = _stream(lambda _: httpx.Response(502, text="bad gateway"))
    assert (record.status, record.error) == (502, "HTTP 502: bad gateway")


def test_stream_cut_short_error_event_and_empty_reply_are_failures():
    cut = _sse({"choices": [{"text": "a"}]})
    record, _ = _stream(lambda _: httpx.Response(200, content=cut))
    assert not record.ok and record.error == "stream ended without [DONE]"
    assert len(record.chunk_times) == 1  # what did arrive is kept

    event = _sse({"choices": [{"text": "a"}]}, {"error": {"message": "engine failed"}}, "[DONE]")
    record, _ = _stream(lambda _: httpx.Response(200, content=event))
    assert not record.ok and record.error == "error event: engine failed"

    named = b'event: error\ndata: {"message": "overloaded"}\n\n'
    record, _ = _stream(lambda _: httpx.Response(200, content=named))
    assert record.error == "error event: overloaded"

    record, _ = _stream(lambda _: httpx.Response(200, content=_sse("[DONE]")))
    assert not record.ok and record.error == "the reply carried no text"

    record, _ = _stream(lambda _: httpx.Response(200, content=b"data: {oops\n\n"))
    assert record.error.startswith("unreadable event")


def test_refused_connection_and_timeout_are_failures():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    record, _ = _stream(refuse)
    assert not record.ok and record.error.startswith("ConnectError")
    assert record.status is None

    async def slow():
        yield _sse({"choices": [{"text": "a"}]})
        await asyncio.sleep(5)
        yield _sse("[DONE]")

    started = time.perf_counter()
    record, _ = _stream(lambda _: httpx.Response(200, content=slow()), timeout=0.1)
    assert time.perf_counter() - started < 3
    assert not record.ok and record.error == "timed out after 0.1 s"


def test_a_chunk_of_several_tokens_gives_one_gap_and_zeros():
    record = StreamRecord(0, 3, 4, 0.0, sent=0.0, ended=1.0)
    record.chunk_times, record.chunk_tokens = [0.1, 0.3, 0.6], [1, 2, None]
    assert token_gaps(record) == [pytest.approx(0.2), 0.0, pytest.approx(0.3)]


# -- sending a run (quill.bench.runner) ------------------------------------------------------
def test_run_caps_concurrency_keeps_arrival_times_and_asks_for_streamed_usage():
    in_flight, most, bodies = 0, 0, []

    async def handler(request: httpx.Request) -> httpx.Response:
        bodies.append((request.url.path, json.loads(request.content)))

        async def reply():
            nonlocal in_flight, most
            in_flight += 1
            most = max(most, in_flight)
            for n, text in enumerate(("a", "b"), 1):
                await asyncio.sleep(0.02)
                usage = {"prompt_tokens": 4, "completion_tokens": n}
                yield _sse({"choices": [{"text": text}], "usage": usage})
            in_flight -= 1  # before [DONE]: the client may stop reading at it
            yield _sse("[DONE]")

        return httpx.Response(200, content=reply())

    target = Target("http://test", "m", "chat", "key", ignore_eos=True, max_concurrency=2)
    requests = [BenchRequest(f"p{i}", 4, 2) for i in range(6)]
    offsets = [0.0] * 5 + [0.3]
    done = []
    records, duration = asyncio.run(
        run_requests(target, requests, offsets, on_done=done.append,
                     transport=httpx.MockTransport(handler))
    )  # fmt: skip
    assert most == 2  # six due at once, never more than two in flight
    assert len(done) == 6 and all(r.ok for r in records)
    assert records[5].sent >= 0.3  # sent at its arrival time, not before
    assert duration == max(r.ended for r in records)
    path, body = bodies[0]
    assert path == "/v1/chat/completions"
    assert body["messages"] == [{"role": "user", "content": body["messages"][0]["content"]}]
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 2
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert {b["messages"][0]["content"] for _, b in bodies} == {f"p{i}" for i in range(6)}
