"""Tool calls over HTTP through the official `openai` client: `tools` with each `tool_choice`,
streamed deltas joined equal to the non-streamed calls, arguments validated by `jsonschema`
against each function's own schema, the client's parse and stream helpers unmodified, tool
results in the conversation, and a 400 naming the field for each thing a client can get wrong.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pydantic
import pytest
from test_server_errors import check_error

CHAT = "/v1/chat/completions"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER,
     "description": "The current weather in a city"}},
    {"type": "function", "function": {"name": "add", "parameters": ADD,
     "description": "The sum of two integers"}},
]  # fmt: skip
PARAMETERS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _joined(stream) -> tuple[list, str, str | None]:
    """(calls as (id, name, arguments), content, finish_reason) of a streamed reply."""
    calls: dict[int, list] = {}
    content, finish_reason = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        finish_reason = choice.finish_reason or finish_reason
        for entry in choice.delta.tool_calls or []:
            call = calls.setdefault(entry.index, [None, None, ""])
            if entry.id is not None:
                assert call[0] is None, "a call's id was sent twice"
                call[0], call[1] = entry.id, entry.function.name
            call[2] += entry.function.arguments or ""
    return [tuple(c) for c in calls.values()], content, finish_reason


@pytest.mark.parametrize("tool_choice", ["required", NAMED, "auto"], ids=str)
def test_tool_calls_stream_as_the_whole_reply_has_them(client, tool_choice):
    kw = dict(model=None, messages=ASK, tools=TOOLS, tool_choice=tool_choice, temperature=0,
              max_tokens=60)  # fmt: skip
    client.chat.completions.create(**kw)  # the prompt now cached, both replies below alike
    whole = client.chat.completions.create(**kw).choices[0]
    calls, content, finish_reason = _joined(client.chat.completions.create(**kw, stream=True))
    assert finish_reason == whole.finish_reason
    message = whole.message
    if message.tool_calls:
        assert message.content is None and content == ""
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
            (name, arguments) for _, name, arguments in calls
        ]
        for call in message.tool_calls:
            assert call.id.startswith("call_") and call.type == "function"
            jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
        assert len(message.tool_calls) == 1  # parallel_tool_calls not asked for
        assert finish_reason == ("stop" if tool_choice == NAMED else "tool_calls")
    else:
        assert tool_choice == "auto" and message.content == content and calls == []
    if tool_choice == NAMED:
        assert message.tool_calls[0].function.name == "get_weather"


def test_the_openai_clients_tool_helpers(client):
    class GetWeather(pydantic.BaseModel):
        """The current weather in a city."""

        city: str
        unit: str

    kw = dict(model=None, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
              tool_choice="required", temperature=0, max_tokens=60)  # fmt: skip
    parsed = client.chat.completions.parse(**kw).choices[0].message.tool_calls[0]
    assert isinstance(parsed.function.parsed_arguments, GetWeather)
    with client.chat.completions.stream(**kw) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_completion().choices[0].message.tool_calls[0]
    assert "tool_calls.function.arguments.delta" in kinds
    assert final.function.parsed_arguments == parsed.function.parsed_arguments


def test_a_conversation_carries_calls_and_their_results(client, http, offline):
    kw = dict(model=None, tools=TOOLS, temperature=0, max_tokens=40)
    first = client.chat.completions.create(**kw, messages=ASK, tool_choice=NAMED)
    call = first.choices[0].message.tool_calls[0]
    conversation = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'},
    ]
    after = client.chat.completions.create(**kw, messages=conversation)
    assert after.choices[0].finish_reason in ("stop", "tool_calls", "length")
    # The prompt the server built, against the model's own template (transformers) applied
    # to the conversation written out by hand in the generic format.
    arguments = json.loads(call.function.arguments)
    by_hand = [
        *ASK,
        {"role": "assistant", "content": json.dumps({"tool_calls": [{"name": "get_weather",
         "arguments": arguments}]}, separators=(",", ":"))},
        {"role": "user", "content": '{"tool_response":{"name":"get_weather",'
                                    '"content":"{\\"temperature\\": 18}"}}'},
    ]  # fmt: skip
    hf = offline.tokenizer.hf
    text = hf.apply_chat_template(by_hand, tokenize=False, add_generation_prompt=True)
    expected = hf(text, add_special_tokens=False)["input_ids"]
    assert http.post("/tokenize", json={"messages": conversation}).json()["tokens"] == expected


def test_tool_choice_none_answers_in_plain_text(client):
    kw = dict(model=None, messages=ASK, temperature=0, max_tokens=8)
    plain = client.chat.completions.create(**kw).choices[0].message
    unused = client.chat.completions.create(**kw, tools=TOOLS, tool_choice="none").choices[0]
    assert unused.message.content == plain.content and not unused.message.tool_calls
    # Tools left unused may go with a structured output.
    reply = client.chat.completions.create(
        **kw, tools=TOOLS, tool_choice="none", response_format={"type": "json_object"}
    )
    assert reply.choices[0].message.content.startswith("{")


BAD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"x": {"type": "frobnicate"}}}}}  # fmt: skip


@pytest.mark.parametrize(
    "body, param",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [], "tool_choice": NAMED}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "get weather"}}]}, "tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": 3}}]}, "tools"),
        ({"tools": [BAD_TOOL]}, "tools"),
        ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tools"),
        ({"messages": [*ASK, {"role": "tool", "content": "1"}]}, "messages"),
        ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{"id": "c", "type":
          "function", "function": {"name": "add", "arguments": "not json"}}]}]}, "messages"),
    ],
)  # fmt: skip
def test_a_bad_tool_request_is_a_400_naming_the_field(http, body, param):
    error = check_error(http.post(CHAT, json={"messages": ASK, "max_tokens": 4, **body}), 400,
                        param)  # fmt: skip
    if body.get("tools") == [BAD_TOOL]:
        assert "frobnicate" in error["message"]  # the library's own reason
