"""Anthropic's Messages API, served: the `anthropic` SDK unmodified against the Qwen3-shaped
model in its own words (tests/server/conftest.py): `messages.create` and `messages.stream`
(text and tool use, streamed equal to whole), `messages.count_tokens` equal to the prompt the
engine counts, a `tool_use` / `tool_result` round trip, stop sequences, thinking switched off
through the template, and each refusal in Anthropic's error shape. The events' order over
random replies is tests/test_response_events.py's.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest
from server_helpers import API_KEY

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"name": "get_weather", "description": "The weather now.", "input_schema": WEATHER}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
# The 2026 SDK no longer has sampling parameters; older clients (Claude Code) still send them.
GREEDY = {"temperature": 0}
# A random model left to think may never close the block; calls come after it.
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def claude(qwen3_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=qwen3_server.base_url, api_key=API_KEY, max_retries=0,
                               timeout=120)  # fmt: skip


@pytest.fixture(scope="module")
def name(qwen3_server) -> str:
    return qwen3_server.ctx.model_name


def _blocks(message) -> list[dict]:
    """The content blocks, call ids aside (each reply makes its own)."""
    return [b.model_dump(exclude_none=True, exclude={"parsed_output", "id"})
            for b in message.content]  # fmt: skip


def _prompt_tokens(base_url: str, messages: list[dict]) -> int:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(f"{base_url}/tokenize", json={"messages": messages}, headers=headers)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_text_whole_and_streamed_and_the_tokens_counted(claude, name, qwen3_server):
    kwargs = dict(model=name, max_tokens=10, system="Be brief.", messages=ASK, extra_body=GREEDY)
    whole = claude.messages.create(**kwargs)
    assert whole.type == "message" and whole.role == "assistant" and whole.id.startswith("msg_")
    assert [b.type for b in whole.content] == ["text"] and whole.content[0].text
    assert whole.stop_reason == "max_tokens" and whole.usage.output_tokens == 10
    counted = claude.messages.count_tokens(model=name, system="Be brief.", messages=ASK)
    expected = _prompt_tokens(qwen3_server.base_url,
                              [{"role": "system", "content": "Be brief."}, *ASK])  # fmt: skip
    assert counted.input_tokens == expected
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == expected

    with claude.messages.stream(**kwargs) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_message()
    assert _blocks(final) == _blocks(whole) and final.stop_reason == whole.stop_reason
    assert final.usage.output_tokens == 10
    # message_start, one text block opened, grown, closed, then the stop reason and the end.
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    body = [e for e in events[1:-2] if e != "text"]  # the SDK adds a "text" event per delta
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}


def test_raw_stream_events_in_anthropic_order(qwen3_server, name):
    headers = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}
    body = {"model": name, "max_tokens": 4, "messages": ASK, "stream": True}
    with httpx.stream("POST", f"{qwen3_server.base_url}/v1/messages", json=body,
                      headers=headers, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    assert names[:2] == ["message_start", "ping"]
    assert names[-2:] == ["message_delta", "message_stop"]
    assert names[2] == "content_block_start" and names[-3] == "content_block_stop"


def test_tool_use_streamed_as_whole_and_a_tool_result_round_trip(claude, name):
    kwargs = dict(model=name, max_tokens=80, messages=ASK, tools=TOOLS, extra_body=GREEDY,
                  tool_choice={"type": "tool", "name": "get_weather"},
                  thinking=NO_THINKING)  # fmt: skip
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    calls = [b for b in whole.content if b.type == "tool_use"]
    assert len(calls) >= 1 and calls[0].name == "get_weather"
    for call in calls:
        jsonschema.validate(call.input, WEATHER)
    with claude.messages.stream(**kwargs) as stream:
        kinds = {e.type for e in stream}
        final = stream.get_final_message()
    assert "input_json" in kinds  # the SDK's event for input_json_delta
    assert _blocks(final) == _blocks(whole)

    results = [{"type": "tool_result", "tool_use_id": c.id, "content": "18 C"} for c in calls]
    history = [*ASK, {"role": "assistant", "content": whole.content},
               {"role": "user", "content": results}]  # fmt: skip
    reply = claude.messages.create(model=name, max_tokens=6, messages=history, tools=TOOLS,
                                   tool_choice={"type": "none"})  # fmt: skip
    assert reply.stop_reason in ("max_tokens", "end_turn")
    assert all(b.type in ("text", "thinking") for b in reply.content)
    counted = claude.messages.count_tokens(model=name, messages=history, tools=TOOLS,
                                           tool_choice={"type": "none"})  # fmt: skip
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == counted.input_tokens
    # The results reach the template as tool messages: the prompt grows with them.
    no_results = claude.messages.count_tokens(
        model=name, messages=history[:2] + [{"role": "user", "content": "ok"}], tools=TOOLS,
        tool_choice={"type": "none"},
    )  # fmt: skip
    assert counted.input_tokens > no_results.input_tokens


def test_any_makes_a_call_and_auto_may_answer(claude, name):
    forced = claude.messages.create(model=name, max_tokens=60, messages=ASK, tools=TOOLS,
                                    tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                    thinking=NO_THINKING,
                                    extra_body=GREEDY)  # fmt: skip
    assert forced.stop_reason == "tool_use"
    assert [b.type for b in forced.content if b.type != "thinking"] == ["tool_use"]
    free = claude.messages.create(model=name, max_tokens=8, messages=ASK, tools=TOOLS)
    assert free.stop_reason in ("tool_use", "max_tokens", "end_turn")


def test_stop_sequence_is_named(claude, name):
    kwargs = dict(model=name, max_tokens=12, messages=ASK, extra_body=GREEDY)
    text = claude.messages.create(**kwargs).content[0].text
    word = text.split()[2] if len(text.split()) > 2 else text[4:8]
    stopped = claude.messages.create(stop_sequences=[word], **kwargs)
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == word
    assert word not in stopped.content[0].text


def test_thinking_disabled_closes_the_block_in_the_prompt(claude, name, qwen3_tok):
    on = claude.messages.count_tokens(model=name, messages=ASK)
    off = claude.messages.count_tokens(model=name, messages=ASK, thinking={"type": "disabled"})
    enabled = claude.messages.count_tokens(
        model=name, messages=ASK, thinking={"type": "enabled", "budget_tokens": 1024}
    )
    closed = qwen3_tok.encode("<think>\n\n</think>\n\n", False)
    assert off.input_tokens == on.input_tokens + len(closed)
    assert enabled.input_tokens == on.input_tokens
    reply = claude.messages.create(model=name, max_tokens=4, messages=ASK,
                                   thinking={"type": "enabled", "budget_tokens": 2})  # fmt: skip
    assert reply.usage.output_tokens == 4


def _anthropic_error(r: httpx.Response, status: int, kind: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == kind
    assert body["error"]["message"]
    return body["error"]["message"]


@pytest.mark.parametrize(
    "change, words",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "image"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "web_search"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": None}, "max_tokens"),
        ({"mcp_servers": [{"url": "http://x"}]}, "mcp_servers"),
        ({"temperature": 1.5}, "temperature"),
        ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, "name"),
        ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, "nope"),
        ({"messages": [{"role": "assistant", "content": [
            {"type": "tool_result", "tool_use_id": "x", "content": "1"}]}]}, "tool_result"),
    ],
)  # fmt: skip
def test_refusals_in_anthropic_shape(qwen3_server, name, change, words):
    headers = {"x-api-key": API_KEY}
    body = {"model": name, "max_tokens": 4, "messages": ASK, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(f"{qwen3_server.base_url}/v1/messages", json=body, headers=headers)
    assert words in _anthropic_error(r, 400, "invalid_request_error")


def test_keys_and_models_in_anthropic_shape(qwen3_server, name):
    url = f"{qwen3_server.base_url}/v1/messages"
    body = {"model": name, "max_tokens": 1, "messages": ASK}
    _anthropic_error(httpx.post(url, json=body, headers={"x-api-key": "wrong"}), 401,
                     "authentication_error")  # fmt: skip
    _anthropic_error(httpx.post(url, json=body), 401, "authentication_error")
    assert httpx.post(url, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=60).status_code == 200  # fmt: skip
    missing = {**body, "model": "claude-sonnet-4-5"}
    message = _anthropic_error(httpx.post(url, json=missing, headers={"x-api-key": API_KEY}),
                               404, "not_found_error")  # fmt: skip
    assert "claude-sonnet-4-5" in message
    # The OpenAI paths keep OpenAI's shape, whichever header carried the key.
    r = httpx.post(f"{qwen3_server.base_url}/v1/chat/completions", json=missing,
                   headers={"x-api-key": API_KEY})  # fmt: skip
    assert r.status_code == 404 and set(r.json()) == {"error"}
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=qwen3_server.base_url, api_key="wrong",
                            max_retries=0).messages.create(**body)  # fmt: skip
