"""A reply as a sequence of parts (its thinking, its text, each call), for the APIs whose replies
are lists of typed parts: the Responses API's output items, the Messages API's content blocks.

`PartStream` reads the reply through the same `ReplyReader` as chat completions (so every API
splits thinking, text and calls alike) and turns its deltas into parts opened, grown and closed
in order: a part of a new kind closes the one before it, the end of the reply closes the last.
A whole reply is the same events read at once, so a stream joined equals the whole reply.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass

from quill.server.tools import ReplyReader

log = logging.getLogger(__name__)

REASONING, TEXT, CALL = "reasoning", "text", "call"


@dataclass
class Part:
    kind: str  # REASONING, TEXT or CALL
    index: int  # its place among the reply's parts
    text: str = ""  # the thinking, the text, or the call's arguments (JSON text) so far
    call_id: str | None = None
    name: str | None = None
    done: bool = False

    def arguments(self) -> dict:
        """A call's arguments as an object ({} if the model's text is not one)."""
        try:
            value = json.loads(self.text) if self.text.strip() else {}
        except json.JSONDecodeError:
            log.warning("call %s: its arguments are not JSON: %.80r", self.name, self.text)
            return {}
        return value if isinstance(value, dict) else {}


@dataclass(frozen=True)
class PartEvent:
    """ "open" (a part begins), "delta" (`piece` appended to it) or "close" (it is complete)."""

    kind: str
    part: Part
    piece: str = ""


class PartStream:
    """One reply's parts, read as the reply arrives."""

    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self.parts: list[Part] = []
        self._open: Part | None = None
        self._calls: dict[int, Part] = {}  # the reader's call index -> its part

    @property
    def calls(self) -> list[Part]:
        return [p for p in self.parts if p.kind == CALL]

    def feed(self, text: str, finished: bool) -> list[PartEvent]:
        """The events that the reply's next piece `text` makes."""
        delta = self.reader.delta(text, finished)
        events: list[PartEvent] = []
        if delta.get("reasoning_content"):
            self._grow(REASONING, delta["reasoning_content"], events)
        if delta.get("content"):
            self._grow(TEXT, delta["content"], events)
        for entry in delta.get("tool_calls", ()):
            function = entry.get("function", {})
            if "id" in entry:
                part = self._start(CALL, events)
                part.call_id, part.name = entry["id"], function["name"]
                self._calls[entry["index"]] = part
                events.append(PartEvent("open", part))
            part = self._calls[entry["index"]]
            piece = function.get("arguments", "")
            if piece:
                part.text += piece
                if part is self._open:
                    events.append(PartEvent("delta", part, piece))
                else:  # the reader finishes a call before it starts anything after it
                    log.warning("arguments of call %s arrived after it closed", part.name)
        if finished:
            self._close(events)
        return events

    def _grow(self, kind: str, piece: str, events: list[PartEvent]) -> None:
        part = self._open
        if part is None or part.kind != kind:
            part = self._start(kind, events)
            events.append(PartEvent("open", part))
        part.text += piece
        events.append(PartEvent("delta", part, piece))

    def _start(self, kind: str, events: list[PartEvent]) -> Part:
        self._close(events)
        part = Part(kind, len(self.parts))
        self.parts.append(part)
        self._open = part
        return part

    def _close(self, events: list[PartEvent]) -> None:
        if self._open is not None:
            self._open.done = True
            events.append(PartEvent("close", self._open))
            self._open = None
