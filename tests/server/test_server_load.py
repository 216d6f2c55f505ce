"""Concurrency, disconnects, the bounded queue and failing steps, against the live server."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from server_helpers import API_KEY, engine_call, sample, wait_until

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}  # runs until aborted


def idle(scrape) -> bool:
    m = scrape()
    return (
        sample(m, "quill:num_requests_running") == 0
        and sample(m, "quill:num_requests_waiting") == 0
        and sample(m, "quill:kv_cache_usage_perc") == 0
    )


def test_32_concurrent_streams(base_url, greedy, scrape, model_name):
    prompts = [f"Question {i}: what is {i} plus {2 * i + 1}? Answer:" for i in range(32)]
    before = scrape()

    async def one(aclient, prompt):
        stream = await aclient.completions.create(
            model=model_name, prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def main():
        aclient = openai.AsyncOpenAI(
            base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=300
        )
        async with aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    texts = asyncio.run(main())
    assert texts == greedy(prompts, 6)
    after = scrape()
    # Some steps produced tokens for more than one request: the batch grew past one.
    name = "quill:iteration_batch_size_bucket"
    steps = sample(after, "quill:iteration_batch_size_count") - sample(
        before, "quill:iteration_batch_size_count"
    )
    single = sample(after, name, le="1.0") - sample(before, name, le="1.0")
    assert steps > single
    big = sample(after, name, le="8.0") - sample(before, name, le="8.0")
    assert steps > big, "no step batched more than 8 of the 32 streams"


def test_disconnect_mid_stream_aborts(base_url, scrape):
    before = scrape()
    body = {"prompt": "Once upon a time", "stream": True, **LONG}
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            events = 0
            for line in r.iter_lines():
                events += line.startswith("data:")
                if events == 3:
                    break
            assert sample(scrape(), "quill:kv_cache_usage_perc") > 0
        # leaving the block closes the connection with the stream unfinished
    wait_until(lambda: idle(scrape))
    after = scrape()
    key = "quill:request_success_total"
    assert sample(after, key, finished_reason="abort") == (
        sample(before, key, finished_reason="abort") + 1
    )


def test_disconnect_mid_request_aborts(base_url, scrape):
    import json
    import socket

    before = scrape()
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"messages": [{"role": "user", "content": "Hi"}], **LONG}).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    # A raw connection, closed once the request runs (not after a fixed time, which a loaded
    # machine may spend before the request is even admitted).
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(head.encode() + body)
        wait_until(lambda: sample(scrape(), "quill:num_requests_running") == 1)
    wait_until(lambda: idle(scrape))
    key = "quill:request_success_total"
    assert sample(scrape(), key, finished_reason="abort") == (
        sample(before, key, finished_reason="abort") + 1
    )


def test_queue_full_gives_503(server, base_url, monkeypatch):
    engine_call(server, "pause")  # requests come in, none is stepped
    monkeypatch.setattr(server.ctx, "max_queued_requests", 2)
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}

    async def main():
        async with httpx.AsyncClient(base_url=base_url, headers=AUTH, timeout=60) as c:
            accepted, refused = [], None
            for _ in range(5):
                in_flight = server.ctx.engine.num_in_flight
                task = asyncio.ensure_future(c.post("/v1/completions", json=body))
                while server.ctx.engine.num_in_flight == in_flight and not task.done():
                    await asyncio.sleep(0.01)
                if task.done():
                    refused = task.result()
                    break
                accepted.append(task)
            engine_call(server, "resume")
            return refused, await asyncio.gather(*accepted)

    refused, accepted = asyncio.run(main())
    assert refused is not None, "the queue never filled"
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["type"] == "server_error"
    assert len(accepted) == 2  # nothing was stepped: both wait
    assert all(r.status_code == 200 for r in accepted)


def test_failed_step_fails_its_requests_then_serving_goes_on(
    server, client, greedy, scrape, model_name, monkeypatch
):
    engine_call(server, "inject_fault", "execute", 1)  # the next model pass raises
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model=model_name, prompt="Hello", max_tokens=3)
    assert "injected fault" in info.value.body["message"]
    ok = client.completions.create(model=model_name, prompt="Hello", max_tokens=3, temperature=0)
    assert ok.choices[0].text == greedy(["Hello"], 3)[0]
    wait_until(lambda: idle(scrape))


def test_step_that_raises_fails_streams_then_serving_goes_on(
    server, base_url, greedy, scrape, monkeypatch
):
    # The first step admits the request, the second one blows up.
    engine_call(server, "inject_fault", "step", 2)
    body = {"prompt": "Hello", "stream": True, "max_tokens": 5}
    with httpx.Client(base_url=base_url, headers=AUTH, timeout=60) as c:
        text = c.post("/v1/completions", json=body).text
        events = [e for e in text.split("\n\n") if e]
        assert events[-1] == "data: [DONE]"
        assert "injected fault" in events[-2] and '"error"' in events[-2]
        wait_until(lambda: idle(scrape))
        ok = c.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
        assert ok.json()["choices"][0]["text"] == greedy(["Hello"], 3)[0]
