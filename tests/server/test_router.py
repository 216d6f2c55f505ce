"""Prefill and decode on two instances behind `quill router` (quill/router, quill/disagg).

A prefill instance and a decode instance (in-process servers, the same flags as the suite's
colocated server) behind a router: greedy replies through the router, streamed or not, equal
the colocated server's; the decode instance computes none of the prompts; both pools end idle,
with no lease left. Then the HTTP fields on their own (ids kept, roles enforced), and a decode
instance given KV that no one holds computes the prompt itself (or fails it, by its flag).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
import uvicorn
from conftest import SERVER_ARGS, running_server
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY, wait_until

from quill.contract.sampling_params import SamplingParams
from quill.router.app import build_router_app

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea:",
    "def fibonacci(n):",
    "One, two, three, four,",
]
CHATS = [[{"role": "user", "content": "What is the tallest mountain on Earth?"}]]
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@contextmanager
def running_router(urls: dict[str, list[str]]) -> Iterator[str]:
    server = uvicorn.Server(
        uvicorn.Config(build_router_app(urls), host="127.0.0.1", port=0, log_level="warning")
    )
    thread = threading.Thread(target=server.run, name="test-router", daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), timeout=30)
    assert server.started, "the router did not start"
    port = server.servers[0].sockets[0].getsockname()[1]
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def split():
    """(router URL, prefill server, decode server)."""
    with running_server(SERVER_ARGS + ["--role", "prefill"]) as prefill:
        decode_args = ["--role", "decode", "--kv-transfer-timeout", "5"]
        with running_server(SERVER_ARGS + decode_args) as decode:
            urls = {"prefill": [prefill.base_url], "decode": [decode.base_url]}
            with running_router(urls) as url:
                yield url, prefill, decode


def _metrics(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", headers=HEADERS).text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def _openai(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_greedy_through_the_router_equals_the_colocated_server(split, client):
    url, prefill, decode = split
    routed = _openai(url)
    kw = dict(max_tokens=24, temperature=0)
    for prompt in PROMPTS:
        want = client.completions.create(model=None, prompt=prompt, **kw).choices[0].text
        got = routed.completions.create(model=None, prompt=prompt, **kw)
        assert got.choices[0].text == want
        stream = routed.completions.create(model=None, prompt=prompt, stream=True, **kw)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want
    for messages in CHATS:
        want = client.chat.completions.create(model=None, messages=messages, **kw)
        got = routed.chat.completions.create(model=None, messages=messages, **kw)
        assert got.choices[0].message.content == want.choices[0].message.content
        stream = routed.chat.completions.create(model=None, messages=messages, stream=True, **kw)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == want.choices[0].message.content
    num_split = 2 * len(PROMPTS) + 2 * len(CHATS)
    got = _metrics(decode.base_url)
    assert got["quill:kv_transfers_total"] >= num_split
    assert got["quill:kv_transferred_prompt_tokens_total"] == 0  # no prompt computed there
    assert got["quill:kv_transfer_failures_total"] == 0
    wait_until(lambda: _metrics(prefill.base_url)["quill:kv_sends_total"] >= num_split)
    # Every lease was fetched and freed; both pools are idle again.
    wait_until(lambda: _metrics(prefill.base_url)["quill:kv_leases"] == 0)
    wait_until(lambda: _metrics(prefill.base_url)["quill:kv_cache_usage_perc"] == 0)
    wait_until(lambda: _metrics(decode.base_url)["quill:kv_cache_usage_perc"] == 0)
    assert _metrics(url)["quill_router:requests_total"] >= num_split


def test_seeded_sampling_through_the_router_equals_the_colocated_server(split, client):
    """The prefill instance draws the first token, the decode instance the rest from the same
    seeded generator moved past that draw: one instance's reply."""
    url, _, _ = split
    routed = _openai(url)
    for prompt in PROMPTS[1:3]:
        kw = dict(model=None, prompt=prompt, max_tokens=16, temperature=1.0, seed=7)
        want = client.completions.create(**kw).choices[0].text
        assert routed.completions.create(**kw).choices[0].text == want
        stream = routed.completions.create(**kw, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == want


def test_a_stop_string_begun_by_the_first_token_streams_as_colocated(split, client):
    """The prefill instance's token ends with the start of a stop string the next token
    completes: the router must not stream those characters before the decode instance,
    which sees the rest, cuts the reply there."""
    url, _, _ = split
    routed = _openai(url)
    kw = dict(model=None, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    first = client.completions.create(**{**kw, "max_tokens": 1}).choices[0].text
    whole = client.completions.create(**kw).choices[0].text
    assert whole.startswith(first) and len(whole) > len(first)
    stop = whole[len(first) - 1 : len(first) + 1]  # across the first two tokens
    want = client.completions.create(**kw, stop=[stop]).choices[0].text
    assert len(want) < len(first)  # the stop cut into the first token's text
    stream = routed.completions.create(**kw, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in stream if c.choices) == want
    assert routed.completions.create(**kw, stop=[stop]).choices[0].text == want


def test_what_the_split_cannot_carry_goes_whole(split, client):
    url, _, decode = split
    before = _metrics(decode.base_url).get("quill:kv_transfers_total", 0)
    routed = _openai(url)
    kw = dict(model=None, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    want = [c.text for c in client.completions.create(**kw).choices]
    assert [c.text for c in routed.completions.create(**kw).choices] == want
    # A tool call, streamed: read as a call by the instance that writes all of it.
    chat = dict(model=None, messages=[{"role": "user", "content": "Weather in Paris?"}],
                tools=[{"type": "function", "function": {"name": "weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                    "required": ["city"], "additionalProperties": False}}}],
                tool_choice="required", max_tokens=30, temperature=0)  # fmt: skip
    call = client.chat.completions.create(**chat).choices[0].message.tool_calls[0].function
    deltas = [c.choices[0].delta for c in routed.chat.completions.create(**chat, stream=True)
              if c.choices]  # fmt: skip
    fragments = [t.function for d in deltas for t in d.tool_calls or []]
    assert fragments[0].name == call.name
    assert "".join(f.arguments or "" for f in fragments) == call.arguments
    assert _metrics(decode.base_url).get("quill:kv_transfers_total", 0) == before
    bad = httpx.post(f"{url}/v1/completions", headers=HEADERS, json={"prompt": "x", "top_p": 7})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_p"
    # Bodies the router reads itself: nested past Python's recursion, not JSON, not UTF-8.
    for body in ("[" * 100_000 + "]" * 100_000, "{nope", b"\xff\xfe"):
        r = httpx.post(f"{url}/v1/completions", headers=HEADERS, content=body)
        assert r.status_code == 400, (body[:8], r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(f"{url}/health").status_code == 200


def test_kv_transfer_params_echo_the_id_and_need_the_role(split, base_url):
    _, prefill, decode = split
    body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
            "kv_transfer_params": {"do_remote_decode": True}}  # fmt: skip
    headers = {**HEADERS, "X-Request-Id": "cmpl-router-7"}
    r = httpx.post(f"{prefill.base_url}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    reply = r.json()
    # The router's id is echoed back; each instance's engine names the request its own way.
    assert r.headers["x-request-id"] == "cmpl-router-7" and reply["id"].startswith("cmpl-")
    params = reply["kv_transfer_params"]
    assert params["remote_request_id"] == reply["id"] + "-0"
    assert reply["usage"]["completion_tokens"] == 1  # the first token only
    decode_body = {**body, "kv_transfer_params": {"do_remote_prefill": True, **params}}
    r = httpx.post(f"{decode.base_url}/v1/completions", json=decode_body, headers=headers)
    assert r.status_code == 200 and r.headers["x-request-id"] == "cmpl-router-7"
    assert r.json()["metrics"]["kv_transfer_bytes"] > 0
    # A role that does not match is a 400 naming the field.
    for url in (decode.base_url, base_url):
        r = httpx.post(f"{url}/v1/completions", json=body, headers=HEADERS)
        assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    r = httpx.post(f"{prefill.base_url}/v1/completions", json={**body, "n": 2}, headers=HEADERS)
    assert r.status_code == 400 and "n = 1" in r.json()["error"]["message"]


def test_kv_no_one_holds_is_computed_on_the_decode_instance(split, client, offline):
    _, _, decode = split
    want = client.completions.create(model=None, prompt=PROMPTS[1], max_tokens=8, temperature=0)
    ids = httpx.post(f"{decode.base_url}/tokenize", json={"prompt": PROMPTS[1]},
                     headers=HEADERS).json()["tokens"]  # fmt: skip
    first = offline.generate([ids], SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
    gone = {
        "do_remote_prefill": True,
        "remote_host": "127.0.0.1",
        "remote_port": 1,  # nobody listens there
        "remote_request_id": "gone-0",
        "remote_block_ids": [0],
        "num_tokens": len(ids),
        "first_token_id": first[0].outputs[0].token_ids[0],
    }
    body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "kv_transfer_params": gone}
    start = time.monotonic()
    r = httpx.post(f"{decode.base_url}/v1/completions", json=body, headers=HEADERS, timeout=60)
    assert time.monotonic() - start < 30
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want.choices[0].text
    got = _metrics(decode.base_url)
    assert got["quill:kv_recomputes_total"] >= 1 and got["quill:kv_transfer_failures_total"] >= 1
    assert got["quill:kv_transferred_prompt_tokens_total"] > 0
