"""OpenAI's Responses API served by quill (quill/server/responses/), driven by the official
clients unmodified on the random-weight Qwen3-shaped model (its template, hermes tool calls, the
qwen3 reasoning parser): a response object and its usage, the typed event stream (its grammar,
sequence numbers, streamed equal to whole), structured output through `responses.parse`, a
function-tool round trip continued by `previous_response_id` and statelessly, reasoning items,
the OpenAI Agents SDK's default Responses model running an agent with a function tool, the store
(retrieve, delete, store false, background, cancel), and the 400s that name the field.

The model's weights are random: what is checked is structure and equalities, never meaning.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field, ValidationError
from server_helpers import API_KEY, engine_call, wait_until

from quill.server.responses.protocol import unpack_thinking
from tests.test_response_events import check_events

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
ASK = "Weather in Paris?"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
ERROR_KEYS = {"message", "type", "param", "code"}
LONG = {"seed": 7, "ignore_eos": True}  # a reply that runs to max_output_tokens


class Report(BaseModel):
    city: str = Field(max_length=10)
    rainy: bool


@pytest.fixture(scope="module")
def model(qwen3_server) -> str:
    return qwen3_server.ctx.model_name


@pytest.fixture(scope="module")
def rhttp(qwen3_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=qwen3_server.base_url, headers=headers, timeout=120) as c:
        yield c


def _tokenized(rhttp, messages: list[dict], **extra) -> int:
    r = rhttp.post("/tokenize", json={"messages": messages, **extra})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def _as_dict(response) -> dict:
    return response if isinstance(response, dict) else response.to_dict()


def _items(response) -> list[dict]:
    """The output items (of a response object or its dict), without what differs between two
    runs (ids)."""
    drop = ("id", "call_id")
    return [{k: v for k, v in item.items() if k not in drop}
            for item in _as_dict(response)["output"]]  # fmt: skip


def _usage(response) -> dict:
    usage = dict(_as_dict(response)["usage"])
    usage.pop("input_tokens_details")  # cached tokens depend on what ran before
    return usage


def _error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    assert body["error"]["param"] == param, body
    return body["error"]


# -- 1. a response object -----------------------------------------------------------------
def test_a_plain_reply_is_a_response_object(qwen3, model, rhttp):
    r = qwen3.responses.create(model=model, input="Hello there", instructions="Be brief.",
                               max_output_tokens=12, temperature=1.0,
                               extra_body={"seed": 3})  # fmt: skip
    assert r.id.startswith("resp_") and r.object == "response" and r.model == model
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
        assert r.usage.output_tokens == 12
    else:
        assert r.incomplete_details is None and r.usage.output_tokens <= 12
    assert r.error is None and r.background is False and r.store is True
    assert r.instructions == "Be brief." and r.max_output_tokens == 12 and r.temperature == 1.0
    assert r.text.format.type == "text" and r.tools == [] and r.tool_choice == "auto"
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_") and message.status == "completed"
    assert [c.type for c in message.content] == ["output_text"]
    assert r.output_text and r.output_text == message.content[0].text
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hello there"}]  # fmt: skip
    assert r.usage.input_tokens == _tokenized(rhttp, messages)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # The counting endpoint counts the same prompt.
    count = qwen3.responses.input_tokens.count(model=model, input="Hello there",
                                               instructions="Be brief.")  # fmt: skip
    assert count.input_tokens == r.usage.input_tokens


def test_input_as_items_is_the_same_conversation_as_chat_messages(qwen3, model, rhttp):
    items = [
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Salut"}]},
        {"role": "user", "content": "How are you?"},
    ]
    r = qwen3.responses.create(model=model, input=items, max_output_tokens=2)
    messages = [{"role": "system", "content": "Answer in French."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Salut"},
                {"role": "user", "content": "How are you?"}]  # fmt: skip
    assert r.usage.input_tokens == _tokenized(rhttp, messages)


# -- 2. the event stream ------------------------------------------------------------------
def test_the_raw_stream_follows_the_grammar_and_equals_the_whole_reply(qwen3, model, rhttp):
    kwargs = dict(model=model, input="Tell me a story", max_output_tokens=16, temperature=1.0,
                  extra_body={"seed": 3})  # fmt: skip
    events = [e.to_dict() for e in qwen3.responses.create(stream=True, **kwargs)]
    types = [e["type"] for e in events]
    text_deltas = types.count("response.output_text.delta")
    assert text_deltas >= 1
    assert types == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * text_deltas,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        types[-1],
    ]  # fmt: skip
    assert types[-1] in ("response.completed", "response.incomplete")
    check_events(events)
    final = events[-1]["response"]
    joined = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert joined == final["output"][0]["content"][0]["text"]
    created = events[0]["response"]
    assert created["status"] == "in_progress" and created["output"] == []

    whole = qwen3.responses.create(**kwargs)
    assert whole.status == final["status"]
    assert _items(whole) == _items(final) and whole.output_text == joined
    assert _usage(whole) == _usage(final)
    # The streamed response was stored as its last event says.
    assert qwen3.responses.retrieve(final["id"]).to_dict() == final

    # On the wire: each event's SSE name is its type.
    body = {"input": "Tell me a story", "max_output_tokens": 4, "stream": True}
    with rhttp.stream("POST", "/v1/responses", json=body) as s:
        assert s.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in s.iter_lines() if line]
    names = [line[7:] for line in lines if line.startswith("event: ")]
    data = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert names == [d["type"] for d in data] and len(lines) == 2 * len(data)
    check_events(data)


def test_the_sdk_stream_helper_accumulates_the_reply(qwen3, model):
    kwargs = dict(model=model, input="Weather report as JSON", text_format=Report,
                  max_output_tokens=40, temperature=1.0, reasoning={"effort": "none"},
                  extra_body={"seed": 5})  # fmt: skip
    with qwen3.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    numbers = [e.sequence_number for e in events]
    assert numbers == list(range(len(numbers)))
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and "".join(e.delta for e in deltas) == final.output_text
    # The helper's running snapshot of the text: the text so far at each delta.
    assert deltas[-1].snapshot == final.output_text
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert done.text == final.output_text and isinstance(done.parsed, Report)
    assert isinstance(final.output_parsed, Report)
    whole = qwen3.responses.parse(**kwargs)
    assert whole.output_parsed == final.output_parsed
    assert _usage(whole) == _usage(final)


# -- 3. structured output -----------------------------------------------------------------
def test_parse_returns_the_pydantic_model(qwen3, model):
    for seed in range(2):
        r = qwen3.responses.parse(model=model, input="Weather report as JSON", text_format=Report,
                                  max_output_tokens=40, temperature=1.0,
                                  reasoning={"effort": "none"},
                                  extra_body={"seed": seed})  # fmt: skip
        assert r.status == "completed"
        assert isinstance(r.output_parsed, Report)
        assert r.text.format.type == "json_schema" and r.text.format.name == "Report"
        jsonschema.validate(json.loads(r.output_text), Report.model_json_schema())
    # json_object: a JSON object, with no schema.
    r = qwen3.responses.create(model=model, input="JSON please", max_output_tokens=40,
                               text={"format": {"type": "json_object"}}, temperature=0,
                               reasoning={"effort": "none"})  # fmt: skip
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)
    else:
        assert r.output_text.lstrip().startswith("{")


# -- 4. a function-tool round trip --------------------------------------------------------
def test_a_tool_round_trip_by_previous_response_id_and_statelessly(qwen3, model):
    first = qwen3.responses.create(model=model, input=ASK, tools=TOOLS, tool_choice="required",
                                   max_output_tokens=40, temperature=1.0,
                                   extra_body={"seed": 0, "thinking_token_budget": 4})  # fmt: skip
    assert first.status == "completed"
    assert first.tool_choice == "required" and first.tools[0].name == "get_weather"
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and first.output[-1] is calls[0]
    call = calls[0]
    assert call.name == "get_weather" and call.status == "completed"
    assert call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER)
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}

    # (a) The server keeps the conversation.
    kept = qwen3.responses.create(model=model, previous_response_id=first.id, input=[result],
                                  tools=TOOLS, max_output_tokens=4,
                                  extra_body=NO_THINKING)  # fmt: skip
    assert kept.previous_response_id == first.id
    assert kept.status in ("completed", "incomplete")
    # (b) The client keeps it: the items given back by hand, nothing stored.
    items = [{"role": "user", "content": ASK}, *first.output, result]
    alone = qwen3.responses.create(model=model, input=items, tools=TOOLS, store=False,
                                   max_output_tokens=4, extra_body=NO_THINKING)  # fmt: skip
    assert alone.status in ("completed", "incomplete") and alone.store is False
    assert kept.usage.input_tokens == alone.usage.input_tokens
    # The counting endpoint agrees, either way.
    for how in (dict(previous_response_id=first.id, input=[result]), dict(input=items)):
        count = qwen3.responses.input_tokens.count(model=model, tools=TOOLS,
                                                   extra_body=NO_THINKING, **how)  # fmt: skip
        assert count.input_tokens == alone.usage.input_tokens


def test_previous_response_id_carries_the_conversation_not_the_instructions(qwen3, model, rhttp):
    first = qwen3.responses.create(model=model, input="Hello", instructions="Be brief.",
                                   max_output_tokens=6, temperature=1.0,
                                   extra_body={"seed": 2})  # fmt: skip
    assert [o.type for o in first.output] == ["message"]
    second = qwen3.responses.create(model=model, previous_response_id=first.id, input="Again",
                                    max_output_tokens=1)  # fmt: skip
    messages = [{"role": "user", "content": "Hello"},
                {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "Again"}]  # fmt: skip
    assert second.usage.input_tokens == _tokenized(rhttp, messages)
    assert second.instructions is None
    third = qwen3.responses.create(model=model, previous_response_id=second.id, input="More",
                                   instructions="Be kind.", max_output_tokens=1)  # fmt: skip
    messages = [{"role": "system", "content": "Be kind."}, *messages,
                {"role": "assistant", "content": second.output_text},
                {"role": "user", "content": "More"}]  # fmt: skip
    assert third.usage.input_tokens == _tokenized(rhttp, messages)


# -- 5. reasoning -------------------------------------------------------------------------
def _thinking_response(qwen3, model, **ask):
    """A constrained reply (a required call, unless `ask` says otherwise) with thinking before
    it: the grammar lets the reply open a think block first, and some seed makes this random
    model do it."""
    ask = ask or {"tools": TOOLS, "tool_choice": "required"}
    for seed in range(16):
        kwargs = dict(model=model, input=ASK, max_output_tokens=40, temperature=1.0,
                      include=["reasoning.encrypted_content"], reasoning={"summary": "auto"},
                      extra_body={"seed": seed, "thinking_token_budget": 4}, **ask)  # fmt: skip
        r = qwen3.responses.create(**kwargs)
        if r.output[0].type == "reasoning":
            return r, kwargs
    raise AssertionError("no seed made the model think")


def test_reasoning_precedes_the_message(qwen3, model):
    schema = {"type": "json_schema", "name": "report", "schema": WEATHER, "strict": True}
    r, _ = _thinking_response(qwen3, model, text={"format": schema})
    assert [o.type for o in r.output] == ["reasoning", "message"]
    thinking = r.output[0].content[0].text
    assert thinking and unpack_thinking(r.output[0].encrypted_content) == thinking
    assert "<think>" not in r.output_text and "</think>" not in r.output_text
    if r.status == "completed":
        jsonschema.validate(json.loads(r.output_text), WEATHER)


def test_reasoning_items_precede_the_call_and_stream_as_whole(qwen3, model):
    r, kwargs = _thinking_response(qwen3, model)
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    reasoning = r.output[0]
    assert reasoning.id.startswith("rs_") and reasoning.status == "completed"
    assert [c.type for c in reasoning.content] == ["reasoning_text"]
    thinking = reasoning.content[0].text
    assert thinking and "<think>" not in thinking and "</think>" not in thinking
    assert unpack_thinking(reasoning.encrypted_content) == thinking
    assert [s.text for s in reasoning.summary] == [thinking]
    assert 0 < r.usage.output_tokens_details.reasoning_tokens <= r.usage.output_tokens
    assert r.reasoning.summary == "auto"

    events = [e.to_dict() for e in qwen3.responses.create(stream=True, **kwargs)]
    check_events(events)
    streamed = events[-1]["response"]
    assert _items(streamed) == _items(r) and _usage(streamed) == _usage(r)
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert deltas == thinking


def test_reasoning_given_back_statelessly_is_accepted(qwen3, model):
    r, _ = _thinking_response(qwen3, model)
    call = r.output[1]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "18 C"}
    reasoning = r.output[0].to_dict()
    # The thinking travels in encrypted_content alone (as a client keeping no state sends it).
    bare = {**reasoning, "content": None}
    counts = []
    for item in (reasoning, bare):
        items = [{"role": "user", "content": ASK}, item, call, result]
        next_turn = qwen3.responses.create(model=model, input=items, tools=TOOLS, store=False,
                                           max_output_tokens=2, extra_body=NO_THINKING)  # fmt: skip
        counts.append(next_turn.usage.input_tokens)
    assert counts[0] == counts[1]


def test_effort_none_closes_the_think_block_in_the_prompt(qwen3, model, qwen3_tok):
    on = qwen3.responses.create(model=model, input=ASK, max_output_tokens=1)
    off = qwen3.responses.create(model=model, input=ASK, max_output_tokens=1,
                                 reasoning={"effort": "none"})  # fmt: skip
    closed = qwen3_tok.encode("<think>\n\n</think>\n\n", False)
    assert off.usage.input_tokens == on.usage.input_tokens + len(closed)
    assert off.reasoning.effort == "none"
    assert [o.type for o in off.output] == ["message"]
    count = qwen3.responses.input_tokens.count(model=model, input=ASK,
                                               reasoning={"effort": "none"})  # fmt: skip
    assert count.input_tokens == off.usage.input_tokens


# -- 6. the Agents SDK --------------------------------------------------------------------
def test_the_agents_sdk_runs_an_agent_on_its_responses_model(qwen3_server, model):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather now in a city."""
        seen.append(city)
        return f"18 C in {city}"

    async def run():
        client = openai.AsyncOpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key=API_KEY,
                                    max_retries=0)  # fmt: skip
        agent = Agent(
            name="weather",
            instructions="Answer with the weather tool.",
            tools=[get_weather],
            model=OpenAIResponsesModel(model=model, openai_client=client),
            model_settings=ModelSettings(
                tool_choice="required", max_tokens=60, temperature=1.0, extra_body=NO_THINKING
            ),  # fmt: skip
            tool_use_behavior="stop_on_first_tool",
        )
        first = await Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        # The next run gives the whole conversation back (the call and its output as items).
        again = first.to_input_list() + [{"role": "user", "content": "And in Rome?"}]
        second = await Runner.run(agent, again, max_turns=3)
        return first, second

    first, second = asyncio.run(run())
    assert len(seen) == 2 and all(isinstance(city, str) for city in seen)
    assert first.final_output == f"18 C in {seen[0]}"
    assert second.final_output == f"18 C in {seen[1]}"
    response = second.raw_responses[0]
    assert [o.type for o in response.output] == ["function_call"]
    assert response.usage.input_tokens > first.raw_responses[0].usage.input_tokens


# -- 7. the store -------------------------------------------------------------------------
def test_retrieve_and_delete(qwen3, model, rhttp):
    r = qwen3.responses.create(model=model, input="Hello", max_output_tokens=3,
                               metadata={"k": "v"})  # fmt: skip
    got = qwen3.responses.retrieve(r.id)
    assert got.to_dict() == r.to_dict() and got.metadata == {"k": "v"}
    deleted = rhttp.delete(f"/v1/responses/{r.id}")
    assert deleted.status_code == 200
    assert deleted.json() == {"id": r.id, "object": "response", "deleted": True}
    error = _error(rhttp.get(f"/v1/responses/{r.id}"), 404, "response_id")
    assert r.id in error["message"] and error["type"] == "invalid_request_error"
    _error(rhttp.delete(f"/v1/responses/{r.id}"), 404, "response_id")
    with pytest.raises(openai.NotFoundError):
        qwen3.responses.retrieve(r.id)
    with pytest.raises(openai.BadRequestError):
        qwen3.responses.retrieve(r.id, stream=True)


def test_a_response_not_stored_cannot_be_found_or_continued(qwen3, model, rhttp):
    r = qwen3.responses.create(model=model, input="Hello", max_output_tokens=3, store=False)
    assert r.store is False
    _error(rhttp.get(f"/v1/responses/{r.id}"), 404, "response_id")
    body = {"input": "Again", "previous_response_id": r.id, "max_output_tokens": 1}
    error = _error(rhttp.post("/v1/responses", json=body), 404, "previous_response_id")
    assert r.id in error["message"]
    counted = rhttp.post("/v1/responses/input_tokens", json=body)
    _error(counted, 404, "previous_response_id")


def test_a_background_response_runs_and_is_polled(qwen3, model):
    r = qwen3.responses.create(model=model, input="Hello", background=True,
                               max_output_tokens=20, extra_body={"seed": 6})  # fmt: skip
    assert r.background is True and r.status in ("queued", "in_progress")
    assert r.output == [] and r.usage is None

    def finished():
        got = qwen3.responses.retrieve(r.id)
        return got if got.status not in ("queued", "in_progress") else None

    done = wait_until(finished, timeout=60)
    assert done.status in ("completed", "incomplete") and done.background is True
    assert done.output_text and done.usage.output_tokens <= 20
    if done.status == "incomplete":
        assert done.incomplete_details.reason == "max_output_tokens"
    # Finished, it can be continued.
    nxt = qwen3.responses.create(model=model, input="More", previous_response_id=r.id,
                                 max_output_tokens=1)  # fmt: skip
    assert nxt.usage.input_tokens > done.usage.input_tokens


def test_cancel_a_background_response(qwen3, model, rhttp):
    r = qwen3.responses.create(model=model, input="Hello", background=True,
                               max_output_tokens=480, extra_body=LONG)  # fmt: skip
    # Still running: it cannot be continued yet.
    body = {"input": "More", "previous_response_id": r.id, "max_output_tokens": 1}
    _error(rhttp.post("/v1/responses", json=body), 400, "previous_response_id")
    cancelled = qwen3.responses.cancel(r.id)
    assert cancelled.id == r.id and cancelled.status == "cancelled"
    assert qwen3.responses.retrieve(r.id).status == "cancelled"
    assert qwen3.responses.cancel(r.id).status == "cancelled"  # again: the same
    # A response that did not run in the background cannot be cancelled.
    plain = qwen3.responses.create(model=model, input="Hello", max_output_tokens=2)
    error = _error(rhttp.post(f"/v1/responses/{plain.id}/cancel"), 400, "response_id")
    assert "background" in error["message"]
    _error(rhttp.post("/v1/responses/resp_missing/cancel"), 404, "response_id")


def test_deleting_a_running_background_response_stops_it(qwen3, model, rhttp):
    r = qwen3.responses.create(model=model, input="Hello", background=True,
                               max_output_tokens=480, extra_body=LONG)  # fmt: skip
    assert rhttp.delete(f"/v1/responses/{r.id}").json()["deleted"] is True
    _error(rhttp.get(f"/v1/responses/{r.id}"), 404, "response_id")
    # The engine is free again: a new request is served.
    assert qwen3.responses.create(model=model, input="Hi", max_output_tokens=2).output_text


def _running(qwen3_server, before: set[str]) -> list[str]:
    """The stored responses made since `before` (ids) that still say they are running."""
    store = qwen3_server.config.app.state.responses
    return [rid for rid, e in list(store.entries.items()) if rid not in before and e.running]


def test_a_stream_the_client_left_does_not_stay_in_progress(qwen3_server, rhttp):
    body = {"input": "Hello", "max_output_tokens": 400, "stream": True, **LONG}
    with rhttp.stream("POST", "/v1/responses", json=body) as s:
        for line in s.iter_lines():
            if line.startswith("data: "):
                response_id = json.loads(line[6:])["response"]["id"]
                break
    # The client has gone (the connection closed after the first event).

    def settled() -> bool:
        r = rhttp.get(f"/v1/responses/{response_id}")
        return r.status_code == 404 or r.json()["status"] not in ("queued", "in_progress")

    # Left in progress, it could never be continued, and the store never lets a running
    # response go (neither for its age nor for size).
    wait_until(settled, timeout=5)


def test_an_engine_failure_fails_the_response(qwen3, qwen3_server, model, rhttp):
    # Streamed: the error event, then response.failed; stored as failed.
    engine_call(qwen3_server, "inject_fault", "execute", 1)  # the next model pass raises
    body = {"input": "Hello", "max_output_tokens": 8, "stream": True}
    with rhttp.stream("POST", "/v1/responses", json=body) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-2:] == ["error", "response.failed"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert set(events[-2]) == {"type", "sequence_number", "code", "message", "param"}
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and set(failed["error"]) == {"code", "message"}
    assert rhttp.get(f"/v1/responses/{failed['id']}").json()["status"] == "failed"

    # In the background: polled until it says failed.
    engine_call(qwen3_server, "inject_fault", "execute", 1)
    r = qwen3.responses.create(model=model, input="Hello", background=True, max_output_tokens=8)

    def finished():
        got = qwen3.responses.retrieve(r.id)
        return got if got.status not in ("queued", "in_progress") else None

    done = wait_until(finished, timeout=30)
    assert done.status == "failed" and done.error is not None

    # Whole: a 5xx, and nothing left running in the store.
    before = set(qwen3_server.config.app.state.responses.entries)
    engine_call(qwen3_server, "inject_fault", "execute", 1)
    with pytest.raises(openai.APIStatusError) as caught:
        qwen3.responses.create(model=model, input="Hello", max_output_tokens=8)
    assert caught.value.status_code >= 500
    assert set(caught.value.body) >= {"message", "type"}
    assert _running(qwen3_server, before) == []
    # Serving goes on.
    assert qwen3.responses.create(model=model, input="Hi", max_output_tokens=2).output_text


# -- 8. refusals --------------------------------------------------------------------------
REFUSED = [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["vs_1"]}]}, "tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image",
                                              "image_url": "https://x/y.png"}]}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["message.output_text.everything"]}, "include"),
    ({"background": True, "stream": True}, "background"),
    ({"background": True, "store": False}, "background"),
    ({"conversation": "conv_123"}, "conversation"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"max_tool_calls": 3}, "max_tool_calls"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"input": []}, "input"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nope"}}}},
     "text.format"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), REFUSED, ids=[p for _, p in REFUSED])
def test_what_quill_does_not_do_is_a_400_naming_the_field(rhttp, body, param):
    error = _error(rhttp.post("/v1/responses", json={"input": "x", **body}), 400, param)
    assert error["type"] == "invalid_request_error"


def test_the_sdk_raises_bad_request_for_a_refused_field(qwen3, model):
    with pytest.raises(openai.BadRequestError) as caught:
        qwen3.responses.create(model=model, input="x", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools"


def test_a_reply_past_the_context_names_max_output_tokens(rhttp, qwen3_server):
    # The prompt fits; the prompt and the reply asked for do not.
    body = {"input": "x", "max_output_tokens": qwen3_server.ctx.max_model_len}
    error = _error(rhttp.post("/v1/responses", json=body), 400, "max_output_tokens")
    assert "context" in error["message"]


def test_an_input_past_the_context_names_input(rhttp, qwen3_server):
    body = {"input": "word " * qwen3_server.ctx.max_model_len, "max_output_tokens": 1}
    _error(rhttp.post("/v1/responses", json=body), 400, "input")


def test_a_bad_input_item_names_its_place(rhttp):
    body = {"input": [{"role": "robot", "content": "x"}]}
    _error(rhttp.post("/v1/responses", json=body), 400, "input.0.role")


def test_without_the_key_it_is_a_401_in_openai_shape(qwen3_server):
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/input_tokens")):  # fmt: skip
        r = httpx.request(method, qwen3_server.base_url + path, json={"input": "x"}, timeout=30)
        assert r.status_code == 401
        assert set(r.json()["error"]) == ERROR_KEYS


def _event_types() -> dict:
    """The SDK's own type of each stream event, by its `type`."""
    from typing import get_args

    from openai.types.responses import ResponseStreamEvent

    union = get_args(get_args(ResponseStreamEvent)[0])
    return {name: cls for cls in union for name in get_args(cls.model_fields["type"].annotation)}


def test_the_objects_and_events_validate_against_the_sdk_types(rhttp):
    """What quill sends, validated (not merely constructed, as the SDK does) against the
    official SDK's types: every field they require is there, of its type."""
    from openai.types.responses import Response

    types = _event_types()
    bodies = [
        {"input": "Hi", "max_output_tokens": 4},
        {"input": "Hi", "max_output_tokens": 4, "include": ["message.output_text.logprobs"],
         "top_logprobs": 2},
        {"input": ASK, "tools": TOOLS, "tool_choice": "required", "max_output_tokens": 40,
         "temperature": 1.0, "seed": 0, "thinking_token_budget": 4,
         "include": ["reasoning.encrypted_content"], "reasoning": {"summary": "auto"}},
    ]  # fmt: skip
    problems: set[str] = set()

    def check(kind, value: dict, name: str) -> None:
        try:
            kind.model_validate(value)
        except ValidationError as e:
            problems.update(f"{name}: {'.'.join(map(str, err['loc']))} {err['type']}"
                            for err in e.errors())  # fmt: skip

    for body in bodies:
        whole = rhttp.post("/v1/responses", json=body)
        assert whole.status_code == 200, whole.text
        check(Response, whole.json(), "response")
        with rhttp.stream("POST", "/v1/responses", json={**body, "stream": True}) as s:
            events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: ")]
        for event in events:
            check(types[event["type"]], event, event["type"])
    assert not problems, sorted(problems)


def test_logprobs_are_included_when_asked(qwen3, model):
    kwargs = dict(model=model, input="Hello", max_output_tokens=6, temperature=1.0,
                  include=["message.output_text.logprobs"], top_logprobs=2,
                  extra_body={"seed": 4, **NO_THINKING})  # fmt: skip
    whole = qwen3.responses.create(**kwargs)
    content = whole.output[0].content[0]
    assert len(content.logprobs) == whole.usage.output_tokens
    assert all(len(lp.top_logprobs) == 2 for lp in content.logprobs)
    assert "".join(lp.token for lp in content.logprobs) == content.text
    events = list(qwen3.responses.create(stream=True, **kwargs))
    streamed = [lp.to_dict() for e in events if e.type == "response.output_text.delta"
                for lp in e.logprobs]  # fmt: skip
    assert streamed == [lp.to_dict() for lp in content.logprobs]
