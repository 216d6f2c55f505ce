"""Ollama's API, served: the `ollama` Python client unmodified against the Qwen3-shaped model
in its own words (tests/server/conftest.py): `list`, `show`, `ps`, `chat` and `generate`
whole and streamed (the stream joined equals the whole reply; Ollama's counts equal the
engine's), `format` with a JSON schema (the reply validated by jsonschema), tools in the
prompt and a call's round trip, `embed` and `embeddings` (the vectors of OpenAI's endpoint on
the same server), the load / unload requests, and refusals in Ollama's error shape."""

from __future__ import annotations

import json

import httpx
import jsonschema
import ollama
import pytest
from server_helpers import API_KEY

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather.",
                                           "parameters": WEATHER}}]  # fmt: skip
ASK = [{"role": "user", "content": "Weather in Paris?"}]
GREEDY = {"temperature": 0, "num_predict": 8}
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def client(qwen3_server) -> ollama.Client:
    return ollama.Client(host=qwen3_server.base_url, headers=HEADERS, timeout=120)


@pytest.fixture(scope="module")
def name(qwen3_server) -> str:
    return qwen3_server.ctx.model_name


def _openai_chat(base_url: str, name: str, **body) -> dict:
    """The same turn through /v1/chat/completions, greedy, 8 tokens, thinking off."""
    body = {"model": name, "max_tokens": 8, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": False}, **body}  # fmt: skip
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_list_show_ps_and_version(client, name, qwen3_server):
    listed = client.list()
    assert [m.model for m in listed.models] == [name]
    assert listed.models[0].size > 0 and listed.models[0].details.family == "qwen3"
    shown = client.show(name)
    assert {"completion", "tools", "thinking"} <= set(shown.capabilities)
    assert shown.modelinfo["general.architecture"] == "qwen3" and shown.template
    assert shown.details.format == "safetensors"
    running = client.ps()
    assert [m.model for m in running.models] == [name]
    assert running.models[0].size > 0 and running.models[0].context_length > 0
    r = httpx.get(f"{qwen3_server.base_url}/api/version", headers=HEADERS)
    assert r.status_code == 200 and r.json()["version"]


def test_chat_whole_and_streamed(client, name, qwen3_server):
    whole = client.chat(model=name, messages=ASK, options=GREEDY, think=False)
    assert whole.done and whole.done_reason == "length" and whole.message.role == "assistant"
    assert whole.eval_count == 8 and whole.message.content
    # The same engine request as OpenAI's chat completions: the same prompt and reply.
    same = _openai_chat(qwen3_server.base_url, name, messages=ASK)
    assert whole.prompt_eval_count == same["usage"]["prompt_tokens"]
    assert whole.message.content == same["choices"][0]["message"]["content"]
    assert whole.total_duration >= whole.eval_duration > 0 and whole.load_duration == 0
    chunks = list(client.chat(model=name, messages=ASK, options=GREEDY, think=False,
                              stream=True))  # fmt: skip
    assert all(not c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    assert chunks[-1].eval_count == 8 and chunks[-1].done_reason == "length"


def test_think_switches_the_templates_thinking(client, name, qwen3_server):
    """think true: the turn OpenAI's chat with thinking on makes (its reasoning_content is
    `thinking`; the reply's cut into parts is tests/test_ollama_chunks.py's); false: the
    template's empty thinking block is in the prompt."""
    thought = client.chat(model=name, messages=ASK, options=GREEDY, think=True)
    same = _openai_chat(qwen3_server.base_url, name, messages=ASK,
                        chat_template_kwargs={"enable_thinking": True})  # fmt: skip
    assert thought.prompt_eval_count == same["usage"]["prompt_tokens"]
    assert thought.message.content == (same["choices"][0]["message"]["content"] or "")
    assert thought.message.thinking == same["choices"][0]["message"].get("reasoning_content")
    plain = client.chat(model=name, messages=ASK, options=GREEDY, think=False)
    assert plain.prompt_eval_count > thought.prompt_eval_count and not plain.message.thinking


def test_generate_whole_streamed_and_raw(client, name, qwen3_server):
    whole = client.generate(model=name, prompt="Weather in Paris?", options=GREEDY, think=False)
    assert whole.done_reason == "length" and whole.eval_count == 8 and whole.response
    assert len(whole.context) == whole.prompt_eval_count + 8
    streamed = list(client.generate(model=name, prompt="Weather in Paris?", options=GREEDY,
                                    think=False, stream=True))  # fmt: skip
    assert "".join(c.response for c in streamed) == whole.response
    raw = client.generate(model=name, prompt="Weather in Paris?", raw=True, options=GREEDY)
    ids = httpx.post(f"{qwen3_server.base_url}/tokenize", json={"prompt": "Weather in Paris?"},
                     headers=HEADERS).json()["tokens"]  # fmt: skip
    assert raw.prompt_eval_count == len(ids) and raw.context[: len(ids)] == ids


def test_format_with_a_schema(client, name):
    reply = client.chat(model=name, messages=ASK, format=WEATHER, think=False,
                        options={"temperature": 0, "num_predict": 60})  # fmt: skip
    jsonschema.validate(json.loads(reply.message.content), WEATHER)
    # "json": any object (a random model's may not close within the limit, but it is one).
    as_json = client.generate(model=name, prompt="Weather?", format="json", think=False,
                              options={"temperature": 0, "num_predict": 20})  # fmt: skip
    assert as_json.response.lstrip().startswith("{")


def test_tools_reach_the_prompt_and_a_call_round_trips(client, name, qwen3_server):
    free = client.chat(model=name, messages=ASK, tools=TOOLS, options=GREEDY, think=False)
    plain = client.chat(model=name, messages=ASK, options=GREEDY, think=False)
    assert free.prompt_eval_count > plain.prompt_eval_count  # the tools are in the prompt
    # Ollama lets the model choose; quill's tool_choice extension forces a call, read back
    # with the client's own types.
    options = {"temperature": 0, "num_predict": 80}
    body = {"model": name, "messages": ASK, "tools": TOOLS, "stream": False, "think": False,
            "tool_choice": "required", "options": options}  # fmt: skip
    r = httpx.post(f"{qwen3_server.base_url}/api/chat", json=body, headers=HEADERS, timeout=120)
    assert r.status_code == 200, r.text
    forced = ollama.ChatResponse.model_validate(r.json())
    calls = forced.message.tool_calls
    assert calls and calls[0].function.name == "get_weather"
    jsonschema.validate(dict(calls[0].function.arguments), WEATHER)
    history = [*ASK, forced.message, {"role": "tool", "tool_name": "get_weather",
                                      "content": "18 C"}]  # fmt: skip
    answered = client.chat(model=name, messages=history, tools=TOOLS, options=GREEDY,
                           think=False)  # fmt: skip
    assert answered.done and answered.prompt_eval_count > forced.prompt_eval_count


def test_embed_and_embeddings_are_the_openai_endpoints_vectors(client, name, qwen3_server):
    texts = ["The sky is blue.", "Paris is in France."]
    got = client.embed(model=name, input=texts)
    assert got.prompt_eval_count > 0 and len(got.embeddings) == 2
    r = httpx.post(f"{qwen3_server.base_url}/v1/embeddings", json={"model": name, "input": texts},
                   headers=HEADERS)  # fmt: skip
    want = [d["embedding"] for d in r.json()["data"]]
    for a, b in zip(got.embeddings, want, strict=True):
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-6
    legacy = client.embeddings(model=name, prompt=texts[0])
    assert max(abs(x - y) for x, y in zip(legacy.embedding, want[0], strict=True)) < 1e-6


def test_load_requests_and_refusals_in_ollama_shape(client, name, qwen3_server):
    loaded = client.chat(model=name, messages=[])
    assert loaded.done and loaded.done_reason == "load"
    assert client.generate(model=name, prompt="").done_reason == "load"
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="no-such-model", messages=ASK)
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model=name, messages=[{"role": "user", "content": "hi", "images": ["aGk="]}])
    assert e.value.status_code == 400 and "images" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model=name, prompt="hi", options={"mirostat": 2})
    assert e.value.status_code == 400 and "mirostat" in e.value.error
    r = httpx.post(f"{qwen3_server.base_url}/api/chat", content=b"{", headers=HEADERS)
    assert r.status_code == 400 and isinstance(r.json()["error"], str)
