"""Issue 8's classes, over HTTP: compatible fields, limits that hold, the door's checks.

Each test would have caught one class of what a hostile tester and a benchmark client found:
unknown fields refused, numbers the engine cannot hold, limits a request could walk past,
bodies of any size or media type, stalled or abandoned bodies, routes without the key.
"""

from __future__ import annotations

import json
import logging
import socket
import time

import httpx
import pytest
from server_helpers import API_KEY
from test_server_errors import check_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def sse_events(text: str) -> list[dict]:
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(e) for e in events[:-1]]


# -- fields ---------------------------------------------------------------------------------
def test_unknown_fields_are_ignored_and_named_in_the_log(http, greedy, caplog):
    caplog.set_level(logging.WARNING, logger="quill.server.app")
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "frobnicate": {"x": 1}}
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy(["Hello"], 3)[0]
    messages = [{"role": "user", "content": "hi", "mood": "happy"}]
    r = http.post(CHAT, json={"messages": messages, "max_tokens": 2, "future_option": True})
    assert r.status_code == 200, r.text
    logged = caplog.text
    for name in ("frobnicate", "future_option", "messages.0.mood"):
        assert name in logged


@pytest.mark.parametrize(
    "path, field, value",
    [
        (COMPLETIONS, "bad_words", ["x"]),
        (COMPLETIONS, "use_beam_search", True),
        (CHAT, "functions", [{"name": "f"}]),
        (CHAT, "function_call", "auto"),
        (CHAT, "modalities", ["text", "audio"]),
    ],
)
def test_known_unsupported_fields_are_refused(http, path, field, value):
    base = {"prompt": "x"} if path == COMPLETIONS else {"messages": USER}
    error = check_error(http.post(path, json={**base, "max_tokens": 1, field: value}), 400, field)
    assert "not supported" in error["message"] or "only" in error["message"]


@pytest.mark.parametrize(
    "field, value",
    [
        ("logit_bias", {}),
        ("use_beam_search", False),
        ("allowed_token_ids", []),
        ("tools", []),  # openai-python's recorded chat body carries one
        ("tool_choice", "none"),
        ("parallel_tool_calls", True),
        ("modalities", ["text"]),
        ("spaces_between_special_tokens", False),
    ],
)
def test_unsupported_fields_that_ask_for_nothing_are_accepted(http, field, value):
    r = http.post(CHAT, json={"messages": USER, "max_tokens": 1, field: value})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**64),
        ("max_tokens", 2**63),
        ("min_tokens", 2**63),
        ("stop_token_ids", [2**64]),
        ("seed", 2**64),
        ("truncate_prompt_tokens", 0),
        ("n", 129),
    ],
)
def test_numbers_the_engine_cannot_hold_are_400(http, field, value):
    body = {"prompt": "x", "max_tokens": 1, field: value}
    check_error(http.post(COMPLETIONS, json=body), 400, field)


def test_overflowing_float_literal_is_400(http):
    raw = b'{"prompt": "x", "max_tokens": 1, "temperature": 1e400}'
    check_error(http.post(COMPLETIONS, content=raw), 400, "temperature")


def test_extreme_sampling_values_behave_as_their_limits(http, greedy):
    want = greedy(["The capital of France is"], 4)[0]
    for extra in ({"temperature": 1e-40}, {"top_p": 1e-300}, {"top_k": 2**63 - 1, "top_p": 1e-9}):
        body = {"prompt": "The capital of France is", "max_tokens": 4, "seed": 1, **extra}
        r = http.post(COMPLETIONS, json=body)
        assert r.status_code == 200, (extra, r.text)
        assert r.json()["choices"][0]["text"] == want, extra
    body = {"prompt": "Hello", "max_tokens": 4, "repetition_penalty": 1e-300, "ignore_eos": True}
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_continuous_usage_in_every_chunk(http):
    for path, base in ((COMPLETIONS, {"prompt": "Hello"}), (CHAT, {"messages": USER})):
        options = {"include_usage": True, "continuous_usage_stats": True}
        body = {**base, "max_tokens": 5, "ignore_eos": True, "stream": True}
        r = http.post(path, json={**body, "stream_options": options})
        assert r.status_code == 200, r.text
        chunks = sse_events(r.text)
        counts = [c["usage"]["completion_tokens"] for c in chunks]
        assert all(c["usage"]["prompt_tokens"] > 0 for c in chunks)
        assert counts == sorted(counts) and counts[-1] == 5
        assert chunks[-1]["choices"] == []


def test_include_stop_str_in_output(http, greedy):
    text = greedy(["Once upon a time"], 12)[0]
    stop = text[len(text) // 2 :][:3]
    body = {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0, "stop": [stop]}
    cut = http.post(COMPLETIONS, json=body).json()["choices"][0]
    kept = http.post(COMPLETIONS, json={**body, "include_stop_str_in_output": True}).json()
    kept = kept["choices"][0]
    assert cut["text"] == text[: text.index(stop)]
    assert kept["text"] == text[: text.index(stop)] + stop
    assert kept["finish_reason"] == cut["finish_reason"] == "stop"


def test_skip_special_tokens(http, offline):
    messages = [{"role": "user", "content": "Say hi."}]
    body = {"messages": messages, "temperature": 0, "max_tokens": 40}
    first = http.post(CHAT, json=body).json()["choices"][0]
    assert first["finish_reason"] == "stop"
    # Run past the end of turn: the special token is in the text only when asked for.
    body = {**body, "ignore_eos": True, "max_tokens": 60}
    shown = http.post(CHAT, json={**body, "skip_special_tokens": False}).json()
    hidden = http.post(CHAT, json=body).json()
    assert "<|im_end|>" in shown["choices"][0]["message"]["content"]
    assert "<|im_end|>" not in hidden["choices"][0]["message"]["content"]


def test_truncate_prompt_tokens(http, offline, greedy):
    prompt = "One two three four five six seven eight nine ten"
    ids = offline.tokenizer.encode(prompt)
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "truncate_prompt_tokens": 4}
    r = http.post(COMPLETIONS, json=body).json()
    assert r["usage"]["prompt_tokens"] == 4
    assert r["choices"][0]["text"] == greedy([ids[-4:]], 3)[0]


# -- limits -----------------------------------------------------------------------------------
def test_sequences_per_request_are_bounded(server, http):
    limit = server.ctx.max_seqs_per_request
    check_error(http.post(COMPLETIONS, json={"prompt": ["a"] * (limit + 1)}), 400, "prompt")
    body = {"prompt": ["a", "b"], "n": limit // 2 + 1, "max_tokens": 1}
    check_error(http.post(COMPLETIONS, json=body), 400, "prompt")
    body = {"messages": USER, "n": limit + 1 if limit < 128 else 128, "max_tokens": 1}
    if limit < 128:
        check_error(http.post(CHAT, json=body), 400, "n")


def test_queue_bound_counts_sequences(server, http, monkeypatch):
    monkeypatch.setattr(server.ctx, "max_queued_requests", 4)
    body = {"prompt": "Hello", "max_tokens": 1, "n": 5}
    error = check_error(http.post(COMPLETIONS, json=body), 400, "n")
    assert "--max-queued-requests" in error["message"]
    body = {"prompt": ["a", "b", "c"], "max_tokens": 1, "n": 2}
    check_error(http.post(COMPLETIONS, json=body), 400, "prompt")
    assert http.post(COMPLETIONS, json={**body, "n": 1}).status_code == 200


def test_a_request_that_can_never_fit_is_400_even_when_the_queue_is_full(server, http, monkeypatch):
    monkeypatch.setattr(server.ctx.engine, "num_waiting", lambda: 10**6)
    body = {"prompt": "x", "max_tokens": 9000}
    check_error(http.post(COMPLETIONS, json=body), 400, "max_tokens")
    check_error(http.post(COMPLETIONS, json={"prompt": "a" * 10**6}), 400, "prompt")
    error = check_error(http.post(COMPLETIONS, json={**body, "max_tokens": 2}), 503)
    assert error["code"] == "overloaded"


def test_body_size_limit(server, http):
    limit = server.ctx.max_request_bytes
    big = json.dumps({"prompt": "a" * limit}).encode()
    error = check_error(http.post(COMPLETIONS, content=big), 413)
    assert str(limit) in error["message"]

    def chunks():  # no Content-Length: the size is counted while reading
        for _ in range(limit // 65536 + 2):
            yield b" " * 65536

    check_error(http.post("/tokenize", content=chunks()), 413)


def test_prompt_longer_than_any_tokenization_fits_is_refused_untokenized(server, http):
    ctx = server.ctx
    text = "a" * (ctx.max_model_len * ctx.tokenizer.max_token_chars + 1)
    if len(text) + 100 > ctx.max_request_bytes:
        pytest.skip("the test server's body limit is below the bound")
    check_error(http.post(COMPLETIONS, json={"prompt": text}), 400, "prompt")
    check_error(http.post("/tokenize", json={"prompt": text}), 400, "prompt")


@pytest.mark.parametrize(
    "content_type, status",
    [
        ("text/plain", 415),
        ("application/x-www-form-urlencoded", 415),
        ("multipart/form-data; boundary=x", 415),
        (None, 200),
        ("application/json", 200),
        ("application/json; charset=utf-8", 200),
        ("application/merge-patch+json", 200),
    ],
)
def test_content_type(base_url, content_type, status):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if content_type is not None:
        headers["Content-Type"] = content_type
    raw = json.dumps({"prompt": "x", "max_tokens": 1}).encode()
    r = httpx.post(f"{base_url}{COMPLETIONS}", content=raw, headers=headers, timeout=60)
    if status == 200:
        assert r.status_code == 200, r.text
    else:
        check_error(r, status)


def _raw_request(base_url: str, head: bytes) -> socket.socket:
    host, port = base_url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=30)
    sock.sendall(head)
    return sock


def _head(length: int) -> bytes:
    return (
        f"POST {COMPLETIONS} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def test_stalled_body_times_out(server, base_url):
    timeout = server.ctx.request_body_timeout
    sock = _raw_request(base_url, _head(100) + b'{"prompt": ')
    start = time.monotonic()
    reply = b""
    while b'"error"' not in reply and time.monotonic() - start < timeout + 10:
        part = sock.recv(4096)
        if not part:
            break
        reply += part
    reply = reply.decode()
    sock.close()
    assert reply.startswith("HTTP/1.1 408"), reply
    assert '"error"' in reply
    assert time.monotonic() - start < timeout + 10


def test_client_leaving_mid_body_is_one_log_line(base_url, http, caplog):
    caplog.set_level(logging.INFO)
    sock = _raw_request(base_url, _head(100) + b'{"prompt": ')
    time.sleep(0.2)
    sock.close()
    deadline = time.monotonic() + 10
    while "left before sending" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "left before sending" in caplog.text
    assert "Traceback" not in caplog.text
    assert all(r.exc_info is None for r in caplog.records)
    assert http.post(COMPLETIONS, json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_every_route_needs_the_key_but_health_and_metrics(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as anon:
        for method, path in (
            ("GET", "/version"),
            ("POST", "/tokenize"),
            ("POST", "/detokenize"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("GET", "/v1/models"),
            ("GET", "/no-such-route"),
        ):
            r = anon.request(method, path, json={"prompt": "x"} if method == "POST" else None)
            assert check_error(r, 401)["code"] == "invalid_api_key", path
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
