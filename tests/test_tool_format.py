"""The generic tool-call format (quill/frontend/tools.py, json_spans.py), without a model.

The scanner's spans are checked against Python's `json` on random JSON cut into random
pieces; the constraint by random walks through its masks on the real tokenizer, each reply
validated by `jsonschema` against the wrapper and each call's arguments against the
function's own schema (independent references); the stream's deltas, joined, against the
whole reply's calls.
"""

from __future__ import annotations

import json
import random

import jsonschema
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.frontend.json_spans import JsonSpans, string_prefix
from quill.frontend.tools import Function, ToolChoice, render_conversation, reply_constraint
from quill.server.tools import ReplyReader
from tests.test_structured_grammar import closing_tokens, walk

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(10**12), 10**12)
    | st.floats(allow_nan=False, allow_infinity=False, allow_subnormal=False)  # FTZ once torch runs
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip
SEPARATORS = [(",", ":"), (", ", ": "), (" ,\n", " :\t")]


def _pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in zip(points, points[1:])]


def _at(value, path):
    for step in path:
        value = value[step]
    return value


def _paths(value, depth: int, prefix=()):
    yield prefix
    if len(prefix) < depth and isinstance(value, dict | list):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            yield from _paths(item, depth, (*prefix, key))


@settings(max_examples=300, deadline=None)
@given(json_values, st.sampled_from(SEPARATORS), st.lists(st.integers(0, 10**6), max_size=8))
def test_spans_are_where_json_puts_each_value(value, separators, cuts):
    text = json.dumps(value, separators=separators, ensure_ascii=False)
    spans = JsonSpans(max_depth=3)
    for piece in _pieces(text, cuts):
        spans.feed(piece)
        assert not spans.broken
    spans.finish()
    assert spans.done
    # Keys repeat in no dict here, so every path is one value.
    expected = set(_paths(value, 3))
    assert set(spans.spans) == expected
    for path in expected:
        assert spans.is_whole(path)
        assert json.loads(spans.value(path)) == _at(value, path)


def test_text_that_breaks_json_is_noticed():
    for text in ['{"a" 1}', '{"a":1 "b":2}', "[1,]x", '{"a":1}{', "{1:2}", "]"]:
        spans = JsonSpans()
        spans.feed(text)
        assert spans.broken, text


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=12), st.booleans())
def test_a_string_cut_anywhere_decodes_to_a_prefix(text, ascii_only):
    raw = json.dumps(text, ensure_ascii=ascii_only)
    seen = ""
    for k in range(1, len(raw) + 1):
        decoded = string_prefix(raw[:k])
        assert text.startswith(decoded) and decoded.startswith(seen)
        seen = decoded
    assert seen == text


LOCATION = {
    "$defs": {"Unit": {"enum": ["celsius", "fahrenheit"]}},
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12},
                   "unit": {"$ref": "#/$defs/Unit"}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}  # fmt: skip
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}  # fmt: skip
FUNCTIONS = [
    Function("get_weather", "Weather in a city", LOCATION),
    Function("add", "Sum of two numbers", ADD),
    Function("now"),  # no parameters: arguments {}
]
PARAMETERS = {"get_weather": LOCATION, "add": ADD, "now": {"maxProperties": 0}}


def test_every_reply_the_constraint_allows_is_a_valid_call_or_answer(grammars, tokenizer):
    rng = random.Random(3)
    closers = closing_tokens(tokenizer)
    choices = [ToolChoice("auto"), ToolChoice("required", parallel=True),
               ToolChoice("named", "get_weather")]  # fmt: skip
    shapes = set()
    for choice in choices:
        constraint = reply_constraint(FUNCTIONS, choice)
        wrapper = json.loads(constraint.value)
        for _ in range(8):
            text = tokenizer.decode(walk(grammars, constraint, rng, closers=closers))
            reply = json.loads(text)
            jsonschema.validate(reply, wrapper)
            if "response" in reply:
                assert choice.mode == "auto" and isinstance(reply["response"], str)
                shapes.add("response")
                continue
            calls = reply["tool_calls"]
            assert len(calls) >= 1 and (choice.parallel or len(calls) == 1)
            for call in calls:
                assert choice.mode != "named" or call["name"] == "get_weather"
                jsonschema.validate(call["arguments"], PARAMETERS[call["name"]])
                shapes.add(call["name"])
    assert {"response", "get_weather", "add", "now"} <= shapes


def test_one_call_a_reply_unless_parallel():
    wrapper = json.loads(reply_constraint(FUNCTIONS, ToolChoice("required")).value)
    two = {"tool_calls": [{"name": "now", "arguments": {}}] * 2}
    try:
        jsonschema.validate(two, wrapper)
    except jsonschema.ValidationError:
        pass
    else:
        raise AssertionError("two calls allowed without parallel_tool_calls")
    parallel = json.loads(reply_constraint(FUNCTIONS, ToolChoice("required", parallel=True)).value)
    jsonschema.validate(two, parallel)


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from(["add", "now", "get_weather"]),
                       st.dictionaries(st.text(max_size=4), json_values, max_size=3)),
             min_size=1, max_size=3),
    st.lists(st.integers(0, 10**6), max_size=12),
)  # fmt: skip
def test_streamed_deltas_join_into_the_whole_replys_calls(calls, cuts):
    text = json.dumps(
        {"tool_calls": [{"name": n, "arguments": a} for n, a in calls]}, separators=(",", ":")
    )
    whole = ReplyReader(ToolChoice("auto")).message(text)
    assert whole["content"] is None
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in whole["tool_calls"]] == calls  # fmt: skip
    stream = ReplyReader(ToolChoice("auto"))
    pieces = _pieces(text, cuts)
    joined: dict[int, dict] = {}
    for i, piece in enumerate(pieces):
        for entry in stream.delta(piece, i == len(pieces) - 1).get("tool_calls", []):
            call = joined.setdefault(entry["index"], {"name": None, "arguments": "", "ids": []})
            if "id" in entry:
                call["ids"].append(entry["id"])
                call["name"] = entry["function"]["name"]
            call["arguments"] += entry.get("function", {}).get("arguments", "")
    assert [(c["name"], c["arguments"]) for c in joined.values()] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]
    ]
    assert all(len(c["ids"]) == 1 for c in joined.values())  # id and name sent once
    assert stream.finish_reason("stop") == "tool_calls"


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=20), st.lists(st.integers(0, 10**6), max_size=12))
def test_a_text_answer_streams_as_its_decoded_text(answer, cuts):
    text = json.dumps({"response": answer}, separators=(",", ":"), ensure_ascii=False)
    stream = ReplyReader(ToolChoice("auto"))
    pieces = _pieces(text, cuts)
    streamed = "".join(
        stream.delta(p, i == len(pieces) - 1).get("content", "") for i, p in enumerate(pieces)
    )
    assert streamed == answer
    whole = ReplyReader(ToolChoice("auto"))
    assert whole.message(text) == {"role": "assistant", "content": answer}
    assert whole.finish_reason("stop") == "stop"


def test_a_reply_cut_before_its_shape_is_its_text():
    calls = ReplyReader(ToolChoice("required"))
    assert calls.message('{"tool_') == {"role": "assistant", "content": '{"tool_'}
    named = ReplyReader(ToolChoice("named", "add"))
    message = named.message('{"tool_calls":[{"name":"add","arguments":{"a":1')
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a":1'}
    assert named.finish_reason("length") == "length"
    assert named.finish_reason("stop") == "stop"  # a named function's call ends with "stop"


def test_a_conversation_with_calls_and_results_is_written_in_the_format():
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}}]},
        {"role": "tool", "content": "-3", "tool_call_id": "c1"},
        {"role": "assistant", "content": "It is -3."},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    offered = render_conversation(messages, FUNCTIONS[:1], ToolChoice("auto"))
    system = offered[0]
    assert system["role"] == "system" and system["content"].startswith("Be brief.\n\n")
    assert '"name":"get_weather"' in system["content"] and '{"response":' in system["content"]
    assert offered[1:] == [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": '{"tool_calls":[{"name":"get_weather","arguments":'
                                         '{"city":"Oslo","unit":"celsius"}}]}'},
        {"role": "user", "content": '{"tool_response":{"name":"get_weather","content":"-3"}}'},
        {"role": "assistant", "content": '{"response":"It is -3."}'},
        {"role": "user", "content": "Thanks"},
    ]  # fmt: skip
    # Tools not offered now: no instructions, text answers left as text; calls still written.
    plain = render_conversation(messages, FUNCTIONS[:1], None)
    assert plain[0] == messages[0] and plain[4] == {"role": "assistant", "content": "It is -3."}
    assert plain[2] == offered[2]
