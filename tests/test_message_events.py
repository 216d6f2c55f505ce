"""Anthropic's stream events over random replies: a reply of thinking, text and hermes calls,
cut at random points, read by the chat reader (quill/server/tools.py) into parts
(quill/server/reply_parts.py) and written as Messages API events
(quill/server/messages/builder.py). Whatever the cuts: the events follow Anthropic's order
(each block started, grown by deltas of its own kind, stopped, one at a time, indices in order;
message_delta and message_stop last), the deltas joined are each block's content, and the
message built from the stream equals the one built from the whole reply."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from quill.frontend.reasoning import REASONING_FORMATS
from quill.frontend.tool_formats import FORMATS
from quill.frontend.tools import ToolChoice
from quill.server.messages.builder import MessageBuilder, usage
from quill.server.reply_parts import PartStream
from quill.server.tools import ReplyReader

_WORD = st.text(alphabet="abc xyz.,!", min_size=1, max_size=12)
_ARGS = st.dictionaries(st.sampled_from(["city", "n", "unit"]),
                        st.integers(0, 99) | _WORD, max_size=3)  # fmt: skip


@st.composite
def replies(draw) -> tuple[str, list[dict]]:
    """A reply's text and the blocks it must make (thinking, text, then calls)."""
    text, blocks = "", []
    if draw(st.booleans()):
        thinking = draw(_WORD)
        text += f"<think>{thinking}</think>"
        if thinking.strip():  # blank thinking makes no block
            blocks.append({"type": "thinking", "thinking": thinking})
    answer = draw(st.one_of(st.just(""), _WORD))
    text += answer
    if answer.strip():
        blocks.append({"type": "text", "text": answer})
    for _ in range(draw(st.integers(0, 2))):
        name, arguments = draw(st.sampled_from(["get_weather", "get_time"])), draw(_ARGS)
        call = json.dumps({"name": name, "arguments": arguments})
        text += f"<tool_call>\n{call}\n</tool_call>"
        blocks.append({"type": "tool_use", "name": name, "input": arguments})
    return text, blocks


def _read(pieces: list[str]) -> tuple[list[dict], MessageBuilder]:
    reader = ReplyReader(ToolChoice("auto"), FORMATS["hermes"], REASONING_FORMATS["qwen3"])
    parts = PartStream(reader)
    builder = MessageBuilder("m")
    events = builder.start(7)
    for i, piece in enumerate(pieces):
        events += builder.apply(parts.feed(piece, i == len(pieces) - 1))
    events += builder.finish("stop", None, bool(parts.calls), usage(7, 2, 5))
    return events, builder


def _content(builder: MessageBuilder) -> list[dict]:
    return [{k: v for k, v in block.items() if k not in ("id", "signature")}
            for block in builder.snapshot()["content"]]  # fmt: skip


@settings(max_examples=150, deadline=None)
@given(replies(), st.data())
def test_events_follow_anthropics_order_wherever_the_reply_is_cut(reply, data):
    text, expected = reply
    cuts = sorted(data.draw(st.sets(st.integers(1, max(len(text) - 1, 1)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])] or [""]
    events, streamed = _read(pieces)
    _, whole = _read([text])
    assert _content(streamed) == _content(whole)
    content = _content(streamed)
    # The reader keeps whitespace around blocks as the model wrote it; compare the words.
    assert [b["type"] for b in content] == [b["type"] for b in expected]
    for got, want in zip(content, expected):
        if got["type"] == "tool_use":
            assert got["name"] == want["name"] and got["input"] == want["input"]
        else:
            key = got["type"] if got["type"] == "thinking" else "text"
            assert got[key].strip() == want[key].strip()

    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "ping"] and kinds[-2:] == [
        "message_delta",
        "message_stop",
    ]
    assert events[0]["message"]["content"] == [] and events[0]["message"]["stop_reason"] is None
    open_index, next_index = None, 0
    joined: dict[int, str] = {}
    delta_kind = {
        "thinking": "thinking_delta",
        "text": "text_delta",
        "tool_use": "input_json_delta",
    }
    started: dict[int, str] = {}
    for e in events[2:-2]:
        if e["type"] == "content_block_start":
            assert open_index is None and e["index"] == next_index
            open_index, next_index = e["index"], next_index + 1
            started[open_index] = e["content_block"]["type"]
            joined[open_index] = ""
        elif e["type"] == "content_block_delta":
            assert e["index"] == open_index
            assert e["delta"]["type"] == delta_kind[started[open_index]]
            joined[open_index] += next(v for k, v in e["delta"].items() if k != "type")
        else:
            assert e["type"] == "content_block_stop" and e["index"] == open_index
            open_index = None
    assert open_index is None and next_index == len(content)
    for index, block in enumerate(content):
        if block["type"] == "tool_use":
            assert json.loads(joined[index]) == block["input"]
        else:
            assert joined[index] == block["thinking" if block["type"] == "thinking" else "text"]
    stop = events[-2]
    assert stop["delta"]["stop_reason"] == ("tool_use" if any(
        b["type"] == "tool_use" for b in expected) else "end_turn")  # fmt: skip
    assert stop["usage"] == {"input_tokens": 5, "cache_creation_input_tokens": 0,
                             "cache_read_input_tokens": 2, "output_tokens": 5}  # fmt: skip


def test_stop_reasons():
    for finish, stop, called, reason in [("length", None, False, "max_tokens"),
                                         ("stop", "END", False, "stop_sequence"),
                                         ("stop", 2, False, "end_turn"),
                                         ("length", None, True, "tool_use")]:  # fmt: skip
        builder = MessageBuilder("m")
        delta = builder.finish(finish, stop, called, usage(3, 0, 1))[0]["delta"]
        assert delta["stop_reason"] == reason
        assert delta["stop_sequence"] == ("END" if reason == "stop_sequence" else None)
