"""Readers of a reply's tool calls, one per way of writing them (quill/frontend/tool_formats.py
says which family writes which): each takes the reply's text in pieces and says, at any point,
the text answer that is safe to show (never a marker still forming, never call JSON) and the
calls begun, name once whole and arguments as the JSON text written so far. The stream and the
whole reply are read by the same reader, so the deltas join into exactly the whole reply's
calls.
"""

from __future__ import annotations

import json

from quill.frontend.json_spans import JsonSpans
from quill.frontend.text_reader import StateReader, partial_suffix
from quill.frontend.tools import ToolReply

ARGUMENT_KEYS = ("arguments", "parameters")


class CallReader(StateReader):
    """What the marker-based readers share: the text outside the calls, and the calls."""

    def __init__(self, state: str, open_: str, special: tuple[str, ...]) -> None:
        super().__init__(state)
        self.open = open_  # the marker a call begins with
        # Markers that are special tokens: never shown as text (a call that broke off leaves
        # its text to the content, as skip_special_tokens would have left it).
        self.special = special
        self.outside = ""  # text outside the calls, read so far

    def calls(self) -> list[tuple[str | None, str]]:
        """(name, arguments text so far) of each call begun; name None until it is whole."""
        raise NotImplementedError

    def _opening(self) -> int | None:
        """Text up to the next opening marker goes outside, and reading moves past the
        marker; returns where it began (None: no marker yet, and a marker's beginning at the
        text's end is held back)."""
        found = self.text.find(self.open, self.pos)
        if found >= 0:
            self.outside += self.text[self.pos : found]
            self.pos = found + len(self.open)
            return found
        keep = partial_suffix(self.text[self.pos :], self.open)
        self.outside += self.text[self.pos : len(self.text) - keep]
        self.pos = len(self.text) - keep
        return None

    @property
    def is_call(self) -> bool:
        return bool(self.calls())

    def content(self) -> str | None:
        """The text outside the calls so far, without whitespace at either end (trailing
        whitespace waits for the text after it)."""
        text = self.outside
        for marker in self.special:
            text = text.replace(marker, "")
        return text.strip() or None


class MarkedCalls(CallReader):
    """Calls written as JSON values after an opening marker amid text: one object each
    (`array` False: hermes, llama3_json) or an array of them (mistral). `close` ends a call
    block where the format has one; `separator` may stand between blocks (llama3's ';')."""

    def __init__(self, open_: str, close: str = "", array: bool = False, separator: str = "",
                 at_start: bool = False, special: tuple[str, ...] = ()) -> None:  # fmt: skip
        super().__init__("start" if at_start else "text", open_, special)
        self.close = close
        self.array = array
        self.separator = separator
        # llama3_json: a reply that begins with '{' is a call without the marker.
        self.at_start = at_start
        self.blocks: list[JsonSpans] = []
        self.block_starts: list[int] = []  # where each block's marker begins
        self.broken_at: int | None = None  # where call JSON stopped being JSON

    # -- reading ----------------------------------------------------------------------------
    def finish(self) -> None:
        self.finished = True
        self._read()
        cut_short = self.state == "call"
        if cut_short:
            self.blocks[-1].finish()
        if self.broken_at is not None or cut_short:
            # The model left the format (or ran out of tokens in a call): a block whose name
            # was never whole is text (nothing of it was streamed as a call), and so is
            # everything after a break.
            if _call_of(self.blocks[-1], ())[0] is None and not self.array:
                self.blocks.pop()
                self.pos = self.block_starts.pop()
            elif self.broken_at is not None:
                self.pos = self.broken_at
            self.state = "text"
        if self.state in ("text", "start") or self.broken_at is not None:
            self.outside += self.text[self.pos :]  # a marker's beginning at the end is text
            self.pos = len(self.text)

    def _stopped(self) -> bool:
        return self.broken_at is not None

    def _start(self) -> None:
        rest = self.text[self.pos :].lstrip()
        if not rest:
            return
        if self.open and self.open.startswith(rest) and len(rest) < len(self.open):
            return  # the tag may be forming
        self.pos = len(self.text) - len(rest)
        if rest.startswith(self.open) and self.open:
            self.pos += len(self.open)
            self._begin_call(self.pos - len(self.open))
        elif rest.startswith("{"):
            self._begin_call(self.pos)
        else:
            self.state = "text"

    def _text(self) -> None:
        found = self._opening()
        if found is not None:
            self._begin_call(found)

    def _begin_call(self, at: int) -> None:
        self.blocks.append(JsonSpans(max_depth=3 if self.array else 2))
        self.block_starts.append(at)
        self.state = "call"

    def _call(self) -> None:
        spans = self.blocks[-1]
        while self.pos < len(self.text) and not spans.done:
            spans.feed(self.text[self.pos])
            self.pos += 1
            if spans.broken:
                self.broken_at = self.pos - 1
                return
        if spans.done:
            self.state = "after"

    def _after(self) -> None:
        """After a call's JSON: its closing marker or the separator, then the next call or
        text."""
        stripped = self.text[self.pos :].lstrip()
        for marker in (self.close, self.separator):
            if not marker:
                continue
            if stripped.startswith(marker):
                self.pos = len(self.text) - len(stripped) + len(marker)
                self.state = "start" if self.at_start else "text"
                return
            if marker.startswith(stripped) and not self.finished:
                return  # the marker may be forming
        if stripped or self.finished:
            self.state = "start" if self.at_start else "text"

    # -- what was read ----------------------------------------------------------------------
    def calls(self) -> list[tuple[str | None, str]]:
        out = []
        for spans in self.blocks:
            if self.array:
                index = 0
                while (index,) in spans.spans:
                    out.append(_call_of(spans, (index,)))
                    index += 1
            elif () in spans.spans:
                out.append(_call_of(spans, ()))
        return out


def _call_of(spans: JsonSpans, at: tuple) -> tuple[str | None, str]:
    name = None
    if spans.is_whole((*at, "name")):
        try:
            name = json.loads(spans.value((*at, "name")))
        except ValueError:
            name = None
        name = name if isinstance(name, str) else None
    for key in ARGUMENT_KEYS:
        arguments = spans.value((*at, key))
        if arguments is not None:
            return name, arguments
    return name, ""


class NamedArgsCalls(CallReader):
    """Mistral's newer calls (v11 tokenizers on: Mistral Small 3.2, Devstral, Magistral):
    `[TOOL_CALLS]name[ARGS]{...}`, once a call, text allowed before."""

    def __init__(self, open_: str, args: str, special: tuple[str, ...] = ()) -> None:
        super().__init__("text", open_, special)
        self.args = args
        self.blocks: list[tuple[int, str | None, JsonSpans]] = []  # (start, name, arguments)

    def finish(self) -> None:
        self.finished = True
        self._read()
        if self.state == "name":  # the name never ended: not a call after all, text
            self.pos = self.blocks.pop()[0]
        elif self.state == "arguments":
            self.blocks[-1][2].finish()
        # Text, and what follows arguments that broke off (their call was streamed).
        self.outside += self.text[self.pos :]
        self.pos = len(self.text)

    def _text(self) -> None:
        found = self._opening()
        if found is not None:
            self.blocks.append((found, None, JsonSpans(max_depth=0)))
            self.state = "name"

    def _name(self) -> None:
        found = self.text.find(self.args, self.pos)
        if found >= 0:
            start, _, spans = self.blocks[-1]
            self.blocks[-1] = (start, self.text[self.pos : found].strip(), spans)
            self.pos, self.state = found + len(self.args), "arguments"

    def _arguments(self) -> None:
        spans = self.blocks[-1][2]
        while self.pos < len(self.text) and not spans.done:
            spans.feed(self.text[self.pos])
            self.pos += 1
            if spans.broken:
                self.pos -= 1
                self.state = "broken"
                return
        if spans.done:
            self.state = "text"

    def _broken(self) -> None:
        pass  # the rest is text (finish)

    def calls(self) -> list[tuple[str | None, str]]:
        return [(name, spans.value(()) or "") for _, name, spans in self.blocks]


class GenericCalls:
    """The generic format's reader (quill/frontend/tools.py) under the same interface."""

    def __init__(self) -> None:
        self.reply = ToolReply()
        self.finished = False

    def feed(self, piece: str) -> None:
        self.reply.feed(piece)

    def finish(self) -> None:
        self.finished = True
        self.reply.finish()

    @property
    def is_call(self) -> bool:
        return self.reply.is_call

    def content(self) -> str | None:
        text = self.reply.content()
        if text is None and self.finished and not self.reply.is_call:
            return self.reply.unread()  # cut short before its shape was known
        return text

    def calls(self) -> list[tuple[str | None, str]]:
        return self.reply.calls()
