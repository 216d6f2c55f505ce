"""The request bodies that benchmark clients and SDKs send, replayed against the server.

Each file in fixtures/client_requests/ is one client's body for one endpoint (vLLM's
`vllm bench serve`, guidellm, genai-perf, LLMPerf, openai-python, LangChain, LiteLLM), written
as our own JSON from the client's sources and documentation or captured from the client against
a recording server; its "source" says which. Every one must be served as the client expects: a
200, a stream that ends with [DONE] (with the usage chunk, or usage in every chunk, when asked
for), or a complete object with usage. A field the server does not know is ignored, as vLLM
does, so that a client written for a newer API still works.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures" / "client_requests"
CASES = {p.stem: json.loads(p.read_text()) for p in sorted(FIXTURES.glob("*.json"))}
PATHS = ("/v1/completions", "/v1/chat/completions")


def with_model(body: dict, model_name: str) -> dict:
    return {**body, "model": model_name} if "model" in body else dict(body)


def max_tokens(body: dict) -> int | None:
    return body.get("max_completion_tokens") or body.get("max_tokens")


def sse_events(response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (comments and blank lines skipped)."""
    return [
        line.removeprefix("data:").strip()
        for line in response.iter_lines()
        if line.startswith("data:")
    ]


def stream(http, path: str, body: dict) -> list[dict]:
    """POST a streaming body; the parsed chunks, after checking the stream ends with [DONE]."""
    with http.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read().decode()
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events and events[-1] == "[DONE]", events[-3:]
    assert "[DONE]" not in events[:-1]
    chunks = [json.loads(e) for e in events[:-1]]
    for c in chunks:
        assert "error" not in c, c
        assert c.get("id"), c
    return chunks


def test_fixtures_are_well_formed():
    assert len(CASES) >= 8
    for name, case in CASES.items():
        assert {"client", "source", "path", "body"} <= case.keys(), name
        assert case["path"] in PATHS, name
        body = case["body"]
        assert body.get("model") == "MODEL", name
        assert ("messages" in body) == (case["path"] == "/v1/chat/completions"), name
        assert max_tokens(body) is not None and max_tokens(body) <= 8, name
    assert any(not c["body"].get("stream") for c in CASES.values())


@pytest.mark.parametrize("name", sorted(CASES))
def test_client_request_is_served(http, model_name, name):
    case = CASES[name]
    body = with_model(case["body"], model_name)
    chat = case["path"] == "/v1/chat/completions"
    limit = max_tokens(body)
    if not body.get("stream"):
        r = http.post(case["path"], json=body)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["id"] and out["object"] == ("chat.completion" if chat else "text_completion")
        assert out["choices"] and all(c["finish_reason"] for c in out["choices"])
        usage = out["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("ignore_eos"):
            assert usage["completion_tokens"] == limit
        return

    chunks = stream(http, case["path"], body)
    options = body.get("stream_options") or {}
    include_usage = bool(options.get("include_usage"))
    continuous = include_usage and bool(options.get("continuous_usage_stats"))
    with_choices = [c for c in chunks if c.get("choices")]
    assert with_choices
    assert any(ch.get("finish_reason") for c in with_choices for ch in c["choices"])
    if include_usage:
        last = chunks[-1]
        assert last["choices"] == [], last
        usage = last["usage"]
        assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if body.get("ignore_eos"):
            assert usage["completion_tokens"] == limit
    else:
        # LLMPerf reads choices[0] of every chunk: without include_usage there is no
        # usage-only chunk.
        assert len(with_choices) == len(chunks)
    if continuous:
        counts = []
        for c in with_choices:
            assert c.get("usage"), c
            assert c["usage"]["prompt_tokens"] > 0
            counts.append(c["usage"]["completion_tokens"])
        assert counts == sorted(counts), counts
        assert counts[-1] <= chunks[-1]["usage"]["completion_tokens"]


@pytest.mark.parametrize("path", PATHS)
def test_unknown_field_is_ignored(http, model_name, path):
    body = {"model": model_name, "max_tokens": 2, "some_future_field": {"x": 1}}
    if "chat" in path:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    r = http.post(path, json=body)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] > 0
