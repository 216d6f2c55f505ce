"""Issue 41's hostile client, kept: a few hundred requests built to take a server down, sent to
a real `quill serve` process while a victim streams beside them.

What must hold over the whole set: the process never dies, no connection is reset, no reply
is a 5xx, every refusal is a 4xx in its API's shape (OpenAI's, Anthropic's on /v1/messages,
Ollama's on /api/) naming a field; the victim's greedy text
is the same every time (fp32, so batching cannot move it); when it is over nothing waits in
the queue and no KV block is held.
"""

from __future__ import annotations

import itertools
import json
import threading

import httpx
import pytest
from server_helpers import sample, wait_until
from test_server_cli import KEY, ServeProcess

from quill.server.embeddings import EmbeddingRequest
from quill.server.errors import ANTHROPIC_TYPES
from quill.server.messages.protocol import MessagesRequest
from quill.server.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
)
from quill.server.protocol import ChatCompletionRequest, CompletionRequest
from quill.server.responses.protocol import ResponsesRequest
from quill.server.scoring import RerankRequest, ScoreRequest

FLAGS = ("--dtype", "float32", "--kv-cache-dtype", "float32", "--quantization", "none",
         "--kv-cache-memory", "128MiB", "--port", "0", "--max-queued-requests", "64",
         "--no-access-log", "--log-level", "warning")  # fmt: skip
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
RESPONSES, MESSAGES = "/v1/responses", "/v1/messages"
EMBEDDINGS, RERANK, SCORE = "/v1/embeddings", "/v1/rerank", "/v1/score"
USER = [{"role": "user", "content": "hi"}]
# Each route's smallest request, and the field that caps its reply.
BASE = {COMPLETIONS: {"prompt": "x"}, CHAT: {"messages": USER}, RESPONSES: {"input": "hi"},
        MESSAGES: {"messages": USER}, EMBEDDINGS: {"input": "hi"},
        RERANK: {"query": "q", "documents": ["d"]},
        SCORE: {"text_1": "a", "text_2": "b"}}  # fmt: skip
CAP = {COMPLETIONS: "max_tokens", CHAT: "max_tokens", RESPONSES: "max_output_tokens",
       MESSAGES: "max_tokens"}  # fmt: skip
# Ollama's routes: each one's smallest request, its reply capped inside `options` (the model is
# named at the run, the served one's).
O_CHAT, O_GENERATE, O_EMBED = "/api/chat", "/api/generate", "/api/embed"
OLLAMA = {O_CHAT: {"messages": USER, "stream": False, "options": {"num_predict": 2}},
          O_GENERATE: {"prompt": "x", "stream": False, "options": {"num_predict": 2}},
          O_EMBED: {"input": "hi"}}  # fmt: skip
VICTIM = {"prompt": "The history of the printing press", "max_tokens": 24, "temperature": 0,
          "ignore_eos": True, "stream": True}  # fmt: skip


# -- hostile values ---------------------------------------------------------------------------
def ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(n)}
    defs[f"d{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/d0", "$defs": defs}


def nested_schema(n: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(n):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def nested_text(n: int) -> str:
    return "[" * n + "]" * n


def lark_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(n)) + f'\nr{n}: "a"'


def gbnf_chain(n: int) -> str:
    return "root ::= r0\n" + "\n".join(f"r{i} ::= r{i + 1}" for i in range(n)) + f'\nr{n} ::= "a"'


def schema_fields(schema) -> list[tuple[str, str, dict]]:
    """(field named in a refusal, route, body fields) carrying `schema` each way a client can."""
    text = schema if isinstance(schema, str) else json.dumps(schema)
    tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
    return [
        ("response_format", CHAT, {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "x", "schema": schema}}}),
        ("guided_json", COMPLETIONS, {"guided_json": schema}),
        ("guided_json", COMPLETIONS, {"guided_json": text}),
        ("structured_outputs", COMPLETIONS, {"structured_outputs": {"json": schema}}),
        ("tools", CHAT, {"tools": [tool], "tool_choice": "required"}),
        ("text", RESPONSES, {"text": {"format": {"type": "json_schema", "name": "x",
                                                 "schema": schema}}}),
        ("tools", RESPONSES, {"tools": [{"type": "function", "name": "f", "parameters": schema}],
                              "tool_choice": "required"}),
        ("output_config", MESSAGES, {"output_config": {"format": {"type": "json_schema",
                                                                  "schema": schema}}}),
        ("tools", MESSAGES, {"tools": [{"name": "f", "input_schema": schema}],
                             "tool_choice": {"type": "any"}}),
    ]  # fmt: skip


def call_with_arguments(arguments: str) -> list[dict]:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return [*USER, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]  # fmt: skip


def refusals() -> list[tuple[str, str, dict, str]]:
    """(case, route, body fields, field the 400 must name)."""
    cases = []
    for schema, why in [
        (ref_chain(5000), "5000 chained $refs"),
        (nested_schema(40), "objects nested 40 deep"),  # 80 levels: past 64, inside the body's
        ({"enum": list(range(200_000))}, "200,000 values"),
        (json.dumps(nested_schema(300)), "objects nested 300 deep, as text"),
    ]:
        for field, route, body in schema_fields(schema):
            cases.append((f"{why} in {field}", route, body, field))
    deep_text = nested_text(100_000)
    cases += [
        ("deep JSON text as guided_json", COMPLETIONS, {"guided_json": deep_text}, "guided_json"),
        ("deep JSON text as structured_outputs.json", COMPLETIONS,
         {"structured_outputs": {"json": deep_text}}, "structured_outputs"),
        ("deep call arguments", CHAT, {"messages": call_with_arguments(deep_text)}, "messages"),
        ("a Lark grammar over the length limit", COMPLETIONS,
         {"guided_grammar": lark_chain(20_000)}, "guided_grammar"),
        ("a regex over the length limit", COMPLETIONS, {"guided_regex": "a" * 200_000},
         "guided_regex"),
        ("a bad schema", CHAT, {"response_format": {"type": "json_schema", "json_schema":
         {"name": "x", "schema": {"type": "frobnicate"}}}}, "response_format"),
        ("an unclosed regex", COMPLETIONS, {"guided_regex": "(a"}, "guided_regex"),
        ("a grammar without its rule", COMPLETIONS, {"guided_grammar": "start: nope"},
         "guided_grammar"),
    ]  # fmt: skip
    tools = [{"type": "function", "function": {"name": "f"}}]
    for choice in [{"type": "function", "function": "f"}, {"type": "function", "function": ["f"]},
                   {"type": "function", "function": 3}, {"function": {"name": "f"}},
                   {"type": "tool", "function": {"name": "f"}}, ["auto"], 7, "sometimes",
                   {"type": "function", "function": {"name": "g"}}]:  # fmt: skip
        cases.append((f"tool_choice {choice!r}", CHAT, {"tools": tools, "tool_choice": choice},
                      "tool_choice"))  # fmt: skip
    array = {"type": "array"}
    for tool in ["f", [1], {"type": "function"}, {"type": "function", "function": "f"},
                 {"type": "function", "function": {"name": 3}},
                 {"type": "function", "function": {"name": "f", "parameters": "x"}},
                 {"type": "function", "function": {"name": "f", "parameters": array}}]:  # fmt: skip
        cases.append((f"tools [{tool!r}]", CHAT, {"tools": [tool]}, "tools"))
    for value in ["json", 3, ["json_object"], {"type": "yaml"}, {"type": "json_schema"},
                  {"type": "json_schema", "json_schema": "x"},
                  {"type": "json_schema", "json_schema": {"schema": {}}}]:  # fmt: skip
        cases.append((f"response_format {value!r}", CHAT, {"response_format": value},
                      "response_format"))  # fmt: skip
    return cases


def ollama_refusals() -> list[tuple[str, str, dict, str]]:
    """(case, route, body fields, field the 400 names) on Ollama's routes."""
    cases = []
    for schema, why in [(ref_chain(5000), "5000 chained $refs"),
                        (nested_schema(40), "objects nested 40 deep"),
                        ({"enum": list(range(200_000))}, "200,000 values")]:  # fmt: skip
        cases.append((f"{why} in format", O_CHAT, {"format": schema}, "format"))
        cases.append((f"{why} in format", O_GENERATE, {"format": schema}, "format"))
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        cases.append((f"{why} in tools", O_CHAT, {"tools": [tool], "tool_choice": "required"},
                      "tools"))  # fmt: skip
    deep = nested_text(100_000)
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": deep}}]}
    cases += [
        ("deep call arguments", O_CHAT,
         {"messages": [*USER, call, {"role": "tool", "content": "ok"}]}, "messages"),
        ("an image", O_CHAT, {"messages": [{**USER[0], "images": ["aGk="]}]}, "images"),
        ("mirostat", O_GENERATE, {"options": {"mirostat": 2, "num_predict": 2}}, "mirostat"),
        ("keep_alive that is no duration", O_GENERATE, {"keep_alive": "for ever"}, "keep_alive"),
        ("a huge input list", O_EMBED, {"input": ["x"] * 5000}, "input"),
        ("a template", O_GENERATE, {"template": "{{ .Prompt }}"}, "template"),
    ]  # fmt: skip
    return cases


def accepted() -> list[tuple[str, str, dict]]:
    """Requests that must be served (they broke servers, or were refused, before)."""
    return [
        ("a 10,000-string enum", CHAT, {"response_format": {"type": "json_schema", "json_schema":
         {"name": "x", "schema": {"enum": [f"v{i}" for i in range(10_000)]}}}}),
        ("a Lark grammar of 3,000 chained rules", COMPLETIONS,
         {"guided_grammar": lark_chain(3000)}),
        ("a GBNF grammar of 3,000 chained rules", COMPLETIONS,
         {"guided_grammar": gbnf_chain(3000)}),
        ("900 chained $refs", COMPLETIONS, {"guided_json": ref_chain(900)}),
        ("objects nested 20 deep", COMPLETIONS, {"guided_json": nested_schema(20)}),
    ]  # fmt: skip


def wrong_types() -> list[tuple[str, str, dict, str]]:
    """Every field of the sampling routes given values of other types: each is served or
    refused naming a field, never a 5xx."""
    values = [{"x": {"y": [1]}}, [1, "a"], "text", -1, 2.5, True, None]
    # The agents' APIs parse through the same field types: four shapes each (object, text,
    # a negative number, null) keep the run inside the suite's time.
    fewer = [{"x": {"y": [1]}}, "text", -1, None]
    cases = []
    routes = ((COMPLETIONS, CompletionRequest, values), (CHAT, ChatCompletionRequest, values),
              (RESPONSES, ResponsesRequest, fewer), (MESSAGES, MessagesRequest, fewer),
              (EMBEDDINGS, EmbeddingRequest, fewer), (RERANK, RerankRequest, fewer),
              (SCORE, ScoreRequest, fewer))  # fmt: skip
    for route, model, shapes in routes:
        for field, value in itertools.product(sorted(model.model_fields), shapes):
            if field.startswith("_"):
                continue
            name = model.model_fields[field].alias or field
            if route == RESPONSES and name == CAP.get(route) and value is None:
                continue  # no other field caps the reply: it would run to the context's end
            cases.append((f"{route} {name}={value!r}", route, {name: value}, name))
    ollama = ((O_CHAT, OllamaChatRequest), (O_GENERATE, OllamaGenerateRequest),
              (O_EMBED, OllamaEmbedRequest))  # fmt: skip
    for (route, model), value in itertools.product(ollama, fewer):
        for name in sorted(model.model_fields):
            if name == "options" and value is None:
                continue  # the cap lives in options: none would run to the context's end
            if name == "options" and isinstance(value, dict):
                value = {**value, "num_predict": 2}
            cases.append((f"{route} {name}={value!r}", route, {name: value}, name))
    return cases


# -- the run --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served():
    served = ServeProcess(*FLAGS)
    try:
        url = served.ready()
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            yield served, http
    finally:
        served.kill()


def stream_text(http: httpx.Client, body: dict, headers: dict | None = None) -> str:
    text = []
    with http.stream("POST", COMPLETIONS, json=body, headers=headers) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    return "".join(text)


class Victim:
    """Streams VICTIM again and again on its own connection until stopped."""

    def __init__(self, url: str) -> None:
        self.texts: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(url,), daemon=True)
        self._thread.start()

    def _run(self, url: str) -> None:
        with httpx.Client(base_url=url, headers=AUTH, timeout=120) as http:
            while not self._stop.is_set():
                try:
                    self.texts.append(stream_text(http, VICTIM, {"X-Request-Id": "victim"}))
                except BaseException as e:  # noqa: BLE001 - the test reports it
                    self.errors.append(e)
                    return

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(120)
        assert not self.errors, self.errors
        return self.texts


def check_reply(r: httpx.Response, case: str, param: str | None = None) -> None:
    error = r.json().get("error") if r.status_code >= 400 else None
    if r.status_code == 503 and isinstance(error, dict) and error["code"] == "overloaded":
        assert r.headers["retry-after"], case  # a tiny ttft_slo_ms: shed, by design
        return
    assert r.status_code < 500, (case, r.status_code, r.text[:300])
    if r.status_code >= 400:
        body = r.json()
        if r.url.path.startswith("/api/"):  # Ollama's shape: the message, naming the field
            assert set(body) == {"error"} and isinstance(error, str) and error, (case, body)
            assert param is None or param in error, (case, error)
            return
        if body.get("type") == "error":  # Anthropic's shape: no param, the message names it
            assert set(body) == {"type", "error"} and set(error) == {"type", "message"}, body
            assert error["type"] == ANTHROPIC_TYPES[r.status_code] and error["message"], error
            assert param is None or param in error["message"], (case, error)
            return
        assert error["type"] == "invalid_request_error" and error["message"], (case, error)
        if param is not None:
            named = error["param"] or ""
            assert named.split(".")[0] == param or named == param, (case, error)


def test_hostile_requests_leave_the_server_and_its_other_clients_alone(served):
    proc, http = served
    model = http.get("/v1/models").json()["data"][0]["id"]
    alone = stream_text(http, VICTIM)
    victim = Victim(str(http.base_url))
    sent = 0
    for case, route, body, param in refusals():
        r = http.post(route, json={**BASE[route], CAP[route]: 4, **body})
        assert r.status_code == 400, (case, r.status_code, r.text[:300])
        check_reply(r, case, param)
        sent += 1
    for case, route, body in accepted():
        base = {"prompt": "Answer:"} if route == COMPLETIONS else {"messages": USER}
        r = http.post(route, json={**base, "max_tokens": 8, "temperature": 0, **body})
        assert r.status_code == 200, (case, r.status_code, r.text[:300])
        sent += 1
    for case, route, body, field in wrong_types():
        # The reply stays short whatever the field (max_completion_tokens wins).
        limit = CAP.get(route)  # the pooling routes generate nothing: no cap
        if field == limit and route in (COMPLETIONS, CHAT):
            limit = "max_completion_tokens"
        cap = {limit: 2} if limit else {}
        base = {**OLLAMA[route], "model": model} if route in OLLAMA else BASE[route]
        r = http.post(route, json={**base, **cap, **body})
        check_reply(r, case)
        if route != MESSAGES and route not in OLLAMA:
            assert r.status_code not in range(400, 500) or r.json()["error"]["param"], case
        sent += 1
    # The console's sign-in and the cookie: nested bodies, a quoted cookie of backslashes.
    for body in (nested_text(100_000), '{"api_key": ' + nested_text(150) + "}", "[]", '"k"'):
        r = http.post("/console/login", content=body, headers={"Content-Type": "application/json"})
        check_reply(r, "console login", "api_key")
        sent += 1
    for case, route, body, param in ollama_refusals():
        r = http.post(route, json={**OLLAMA[route], "model": model, **body})
        assert r.status_code == 400, (case, r.status_code, r.text[:300])
        check_reply(r, case, param)
        sent += 1
    cookie = 'quill_console="' + "\\" * 15_000 + '"'
    r = httpx.get(f"{str(http.base_url).rstrip('/')}/v1/models", headers={"Cookie": cookie})
    assert r.status_code == 401
    # A client that reuses the victim's X-Request-Id touches nothing of the victim's.
    for _ in range(3):
        reused = {"X-Request-Id": "victim"}
        r = http.post(COMPLETIONS, json={"prompt": "Hi", "max_tokens": 2}, headers=reused)
        assert r.status_code == 200 and r.headers["x-request-id"] == "victim", r.text
        sent += 1
    texts = victim.stop()
    assert sent >= 300
    assert texts and all(t == alone for t in texts), (alone, texts)
    assert proc.proc.poll() is None, "the server died"
    assert http.get("/health").status_code == 200

    def idle() -> bool:
        from prometheus_client.parser import text_string_to_metric_families

        values = {}
        for family in text_string_to_metric_families(http.get("/metrics").text):
            for s in family.samples:
                labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
                values[(s.name, labels)] = s.value
        return (
            sample(values, "quill:num_requests_running") == 0
            and sample(values, "quill:num_requests_waiting") == 0
            and sample(values, "quill:kv_cache_usage_perc") == 0
        )

    wait_until(idle, timeout=60)


def test_a_grammar_too_slow_later_is_the_requests_own_4xx(served, tokenizer):
    """An ambiguous grammar's masks grow with the reply; the reply that passes the budget ends
    with a 400 naming its field (an error event when streamed), and the server serves on."""
    _, http = served
    vocab = tokenizer.get_vocab_size()
    # Only a's: a "b" would end the reply before its masks grow.
    with_b = {str(t): -100 for t in range(vocab) if "b" in tokenizer.decode([t])}
    ambiguous = 'start: x "b"\nx: "a" | x x | x x x | x x x x'
    body = {"prompt": "Write a's:", "max_tokens": 400, "temperature": 0,
            "guided_grammar": ambiguous, "logit_bias": with_b}  # fmt: skip
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "guided_grammar" and "mask took" in error["message"], error
    assert error["code"] == "constraint_failed"
    events = []
    with http.stream("POST", COMPLETIONS, json={**body, "stream": True}) as s:
        assert s.status_code == 200
        events = [line for line in s.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["error"]["type"] == "invalid_request_error", last
    assert last["error"]["param"] == "guided_grammar"
    assert http.get("/health").status_code == 200


def test_a_keyword_the_grammar_cannot_enforce_is_served_and_named(served):
    """uniqueItems (and the like): served as vLLM serves it, the ignored keyword named in a
    response header."""
    _, http = served
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    body = {"messages": USER, "max_tokens": 16, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "ints",
                                "schema": schema}}}  # fmt: skip
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), list)
    assert "uniqueItems" in r.headers["x-quill-warning"]
    assert r.headers["x-quill-warning"].startswith("response_format:")
    with http.stream("POST", CHAT, json={**body, "stream": True}) as s:
        assert s.status_code == 200 and "uniqueItems" in s.headers["x-quill-warning"]
