"""Ollama's chat chunks over random replies: a reply of thinking, text and hermes calls, cut
at random points, read by the chat reader into parts and written as Ollama's chunks
(quill/server/ollama/routes.py). Whatever the cuts: the chunks' thinking joined is the
thinking, their content joined is the answer, and each call comes once, whole, in order, as
the `ollama` client's own types read it."""

from __future__ import annotations

import json

import ollama
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.frontend.reasoning import REASONING_FORMATS
from quill.frontend.tool_formats import FORMATS
from quill.frontend.tools import ToolChoice
from quill.server.ollama.routes import _Reply
from quill.server.reply_parts import PartStream
from quill.server.tools import ReplyReader

_WORD = st.text(alphabet="abc xyz.,!", min_size=1, max_size=12)
_ARGS = st.dictionaries(st.sampled_from(["city", "n"]), st.integers(0, 99) | _WORD, max_size=2)


@st.composite
def replies(draw) -> tuple[str, str, str, list[dict]]:
    text, thinking = "", ""
    if draw(st.booleans()):
        thinking = draw(_WORD)
        text += f"<think>{thinking}</think>"
    answer = draw(st.one_of(st.just(""), _WORD))
    text += answer
    calls = []
    for _ in range(draw(st.integers(0, 2))):
        name, arguments = draw(st.sampled_from(["get_weather", "get_time"])), draw(_ARGS)
        text += f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"
        calls.append({"name": name, "arguments": arguments})
    return text, thinking, answer, calls


@settings(max_examples=150, deadline=None)
@given(replies(), st.lists(st.integers(0, 200), max_size=8))
def test_chunks_carry_the_reply_whatever_the_cuts(reply, cuts):
    text, thinking, answer, calls = reply
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [""]
    reader = ReplyReader(ToolChoice("auto"), FORMATS["hermes"], REASONING_FORMATS["qwen3"])
    out = _Reply("m", None, None, PartStream(reader), chat=True)
    chunks = []
    for i, piece in enumerate(pieces):
        chunks += out._pieces(piece, i == len(pieces) - 1)
    read = [ollama.ChatResponse.model_validate(c) for c in chunks]
    assert all(not r.done and r.message.role == "assistant" for r in read)
    assert "".join(r.message.thinking or "" for r in read).strip() == thinking.strip()
    assert "".join(r.message.content or "" for r in read).strip() == answer.strip()
    got = [{"name": c.function.name, "arguments": dict(c.function.arguments)}
           for r in read for c in r.message.tool_calls or []]  # fmt: skip
    assert got == calls
