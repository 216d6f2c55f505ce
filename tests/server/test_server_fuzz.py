"""Fuzzing every POST route from the server's own OpenAPI document.

Bodies are drawn from the request schemas the server publishes (schema_strategy.py), two thirds
valid by the schema and a third with one field replaced by arbitrary JSON. Whatever comes in:
no 5xx, the engine keeps serving, and once the requests are done no KV block is held.
Generation lengths are capped (max_tokens <= 4) so the cases fit the CI budget; everything
else is as drawn.
"""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schema_strategy import from_schema
from server_helpers import engine_call, wait_until

ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages",
          "/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/v1/score", "/tokenize",
          "/detokenize", "/api/chat", "/api/generate", "/api/embed"]  # fmt: skip
SCORING = ("/v1/rerank", "/v1/score")
_CAPPED = ("max_tokens", "max_completion_tokens", "max_output_tokens", "min_tokens")

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)  # JSON has none
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=5,
)


# Fields whose drawn values are mostly a 400 (a random schema, regex, tool or token-id key).
_RESPONSES_REFUSED = ("conversation", "truncation", "prompt", "context_management",
                      "max_tool_calls", "background", "previous_response_id")  # fmt: skip
_MOSTLY_BAD = ("response_format", "structured_outputs", "guided_json", "guided_regex",
               "guided_choice", "guided_grammar", "logit_bias", "tools", "tool_choice")  # fmt: skip


def bounded(body, path: str, model: str):
    """Cap the work a drawn body asks for (at most 4 new tokens, 1 or 2 sequences), and name
    the served model in most bodies that name one (a random name is only ever a 404)."""
    if not isinstance(body, dict):
        return body
    if isinstance(body.get("model"), str) and len(body["model"]) % 4:
        body["model"] = model
    if path.startswith("/api/"):  # Ollama's: its reply's length is options.num_predict
        options = body.get("options")
        if isinstance(options, dict):
            predict = options.get("num_predict")
            if not isinstance(predict, int) or isinstance(predict, bool) or predict < 0:
                options["num_predict"] = 4
            else:
                options["num_predict"] = min(predict, 4)
        elif path != "/api/embed":
            body["options"] = {"num_predict": 4}
        if len(body) % 3:  # a drawn schema is mostly a 400
            body.pop("format", None)
        return body
    if not path.startswith("/v1"):
        return body
    # Drawn constraints are left out of every body (they are not drawn, see `openapi`, but
    # a mutated body may carry one): a random grammar is the structured-output tests'
    # business (tests/server/test_structured_api.py).
    for name in _MOSTLY_BAD:
        body.pop(name, None)
    # Rules across fields that a JSON schema cannot state, made to hold in most bodies so that
    # most valid-by-schema bodies reach the engine (a third keep them broken).
    if len(body) % 3:
        if body.get("stream") is not True:
            body.pop("stream_options", None)
        if body.get("logprobs") is not True and path.endswith("chat/completions"):
            body.pop("top_logprobs", None)
        if path == "/v1/completions" and len(body) % 2:  # drawn token ids: mostly a 400
            body["prompt"] = "Hello"
        if path == "/v1/responses":  # fields refused when set (the hostile client's business)
            for name in _RESPONSES_REFUSED:
                body.pop(name, None)
            if body.get("input") in (None, "", []):  # drawn empty or left out: a 400
                body["input"] = "Hello"
    for name in _CAPPED:
        if isinstance(body.get(name), int) and not isinstance(body[name], bool):
            body[name] = min(body[name], 4)
    # Chat would otherwise run to the end of the context (the Responses API names it its way).
    cap = "max_output_tokens" if path == "/v1/responses" else "max_tokens"
    pools = ("/v1/messages/count_tokens", "/v1/embeddings", "/v1/rerank", "/v1/score")
    if body.get(cap) is None and path not in pools:  # null asks for no cap: the context
        body[cap] = 4
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = min(body["n"], 2)
    if isinstance(body.get("prompt"), list) and body["prompt"]:
        body["prompt"] = body["prompt"][:2]
    return body


@pytest.fixture(scope="module")
def openapi(http: httpx.Client) -> dict:
    r = http.get("/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    # Free-form JSON fields (schemas, constraints, token-id maps) are not drawn: `bounded`
    # drops them anyway, and drawing arbitrary JSON for them made a run take minutes.
    for schema in spec["components"]["schemas"].values():
        for name in _MOSTLY_BAD:
            schema.get("properties", {}).pop(name, None)
    return spec


def mutated(valid: st.SearchStrategy) -> st.SearchStrategy:
    def replace(body: dict, data) -> dict:
        if not isinstance(body, dict) or not body:
            return body
        name = data.draw(st.sampled_from(sorted(body)))
        return {**body, name: data.draw(_json)}

    return st.tuples(valid, st.data()).map(lambda t: replace(*t))


@pytest.mark.parametrize("path", ROUTES)
def test_fuzz_from_openapi_schema(server, http, openapi, path, greedy, model_name):
    body = openapi["paths"][path]["post"]["requestBody"]["content"]["application/json"]
    valid = from_schema(body["schema"], openapi)
    statuses: list[int] = []

    @settings(
        max_examples=40,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        database=None,
        derandomize=True,  # the same bodies on every machine: a failure here reproduces
    )
    @given(st.one_of(valid, valid, mutated(valid)))
    def check(body):
        payload = json.dumps(bounded(body, path, model_name), allow_nan=False).encode()
        r = http.post(path, content=payload)
        statuses.append(r.status_code)

        # A 503 "overloaded" is an answer, not a failure: the body may carry a ttft_slo_ms
        # too tight to meet.
        error = r.json()["error"] if r.status_code >= 400 else None
        message = error if path.startswith("/api/") else (error or {}).get("message")
        overloaded = r.status_code == 503 and "overloaded" in r.text
        assert r.status_code < 500 or overloaded, (payload, r.text[:500])
        if r.status_code >= 400:  # in the API's own shape (Ollama's: the message alone)
            assert isinstance(message, str) and message and "Traceback" not in message

    check()
    # The default model generates: it scores nothing, so every rerank and score body is a 400
    # (drawn bodies still must never make a 5xx); the other routes accept some.
    if path not in SCORING:
        assert any(s == 200 for s in statuses), f"no drawn body was accepted: {statuses}"
    engine = server.ctx.engine
    wait_until(
        lambda: engine.num_in_flight == 0 and engine_call(server, "state")["kv_cache_usage"] == 0
    )
    assert engine.is_alive
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert ok.json()["choices"][0]["text"] == greedy(["Hello"], 3)[0]
