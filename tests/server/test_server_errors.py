"""Bad input and access: the right status and OpenAI's error body, never a 500."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from server_helpers import API_KEY

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "hi"}]


def check_error(r: httpx.Response, status: int, param: str | None = "unset") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert body.keys() == {"error"}
    error = body["error"]
    assert error.keys() == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert "Traceback" not in error["message"]
    if param != "unset":  # the field, or a part of it ("messages.0.role")
        assert error["param"] == param or str(error["param"]).startswith(f"{param}.")
    return error


@pytest.mark.parametrize(
    "path, body, param",
    [
        # wrong types: strict, as OpenAI's API is
        (COMPLETIONS, {"prompt": "x", "max_tokens": "8"}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 8.5}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "temperature": "hot"}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "stream": "yes"}, "stream"),
        (COMPLETIONS, {"prompt": 5}, "prompt"),
        (COMPLETIONS, {"prompt": [1, "a"]}, "prompt"),
        (COMPLETIONS, {"prompt": "x", "stop": 3}, "stop"),
        (CHAT, {"messages": "hi"}, "messages"),
        (CHAT, {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
        (CHAT, {"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        (CHAT, {"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        # missing or empty
        (COMPLETIONS, {"max_tokens": 3}, "prompt"),
        (COMPLETIONS, {"prompt": ""}, "prompt"),
        (COMPLETIONS, {"prompt": []}, "prompt"),
        (CHAT, {"messages": []}, "messages"),
        # out of range
        (COMPLETIONS, {"prompt": "x", "temperature": 2.5}, "temperature"),
        (COMPLETIONS, {"prompt": "x", "top_p": 0}, "top_p"),
        (COMPLETIONS, {"prompt": "x", "n": 0}, "n"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "logprobs": 21}, "logprobs"),
        (COMPLETIONS, {"prompt": "x", "presence_penalty": 3}, "presence_penalty"),
        (COMPLETIONS, {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
        (COMPLETIONS, {"prompt": [10**9]}, "prompt"),
        (CHAT, {"messages": USER, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        (CHAT, {"messages": USER, "top_logprobs": 2}, "top_logprobs"),
        (CHAT, {"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
        # over the model's context (8192 tokens)
        (COMPLETIONS, {"prompt": "x", "max_tokens": 9000}, "max_tokens"),
        (CHAT, {"messages": USER, "max_completion_tokens": 9000}, "max_tokens"),
        (COMPLETIONS, {"prompt": [100] * 8192, "max_tokens": 1}, "prompt"),
        # unsupported
        # prompt logprobs: bounded, not streamed (as in vLLM), max_tokens 0 only to score
        (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        (COMPLETIONS, {"prompt": "x", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        (CHAT, {"messages": USER, "prompt_logprobs": 0, "stream": True}, "prompt_logprobs"),
        (CHAT, {"messages": USER, "max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens"),
        (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ],
)
def test_bad_request(http, path, body, param):
    error = check_error(http.post(path, json=body), 400, param)
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("raw", [b"", b"{", b'{"prompt": "x",}', b"[1, 2]", b"null", b"\xff"])
def test_invalid_json(http, raw):
    for path in (COMPLETIONS, CHAT):
        check_error(http.post(path, content=raw), 400)


def test_unknown_model(http, client):
    for path, body in ((COMPLETIONS, {"prompt": "x"}), (CHAT, {"messages": USER})):
        error = check_error(http.post(path, json={**body, "model": "gpt-4"}), 404, "model")
        assert error["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    check_error(http.get("/v1/models/nope"), 404)


def test_openai_client_sees_400(client, model_name):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model_name, prompt="x", max_tokens=9000)
    assert info.value.body["param"] == "max_tokens"


def test_api_key(base_url, model_name):
    with httpx.Client(base_url=base_url, timeout=30) as anon:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
            for method, path, body in (
                ("GET", "/v1/models", None),
                ("POST", COMPLETIONS, {"prompt": "x", "max_tokens": 1}),
                ("POST", CHAT, {"messages": USER, "max_tokens": 1}),
            ):
                r = anon.request(method, path, json=body, headers=headers)
                assert check_error(r, 401)["code"] == "invalid_api_key"
        assert anon.get("/health").status_code == 200
        assert anon.get("/metrics").status_code == 200
        ok = anon.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200
    bad = openai.OpenAI(base_url=f"{base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=model_name, prompt="x", max_tokens=1)


def test_unknown_route_and_method(http):
    check_error(http.get("/v1/nothing-here"), 404)
    check_error(http.get(COMPLETIONS), 405)


# Floats without subnormals: torch sets flush-to-zero in this process, which hypothesis refuses.
_json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_subnormal=False)
    | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=6,
)
_fields = st.sampled_from(
    [
        "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
        "repetition_penalty", "seed", "stop", "ignore_eos", "logprobs", "echo", "prompt",
        "stream_options", "user", "best_of", "min_tokens", "stop_token_ids", "model",
    ]
)  # fmt: skip


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.dictionaries(_fields, _json_values, max_size=3))
def test_fuzzed_fields_never_500(http, fields):
    # max_tokens stays 1 so that requests that happen to be valid cost one token.
    body = {"prompt": "Hello", **fields, "max_tokens": 1}
    try:
        payload = json.dumps(body, allow_nan=True).encode()
    except (TypeError, ValueError):
        return
    r = http.post(COMPLETIONS, content=payload)
    assert r.status_code in (200, 400, 404), r.text
    if r.status_code != 200:
        check_error(r, r.status_code)
