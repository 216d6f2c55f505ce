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
        pieces = self._cut(text)
        events: list[PartEvent] = []
        for i, piece in enumerate(pieces):
            events += self._feed(piece, finished and i == len(pieces) - 1)
        return events

    def _cut(self, text: str) -> list[str]:
        """`text` cut where a call's marker begins and ends. The reader's delta says what of
        the text and of the calls grew, not in which order; one change between text and a call
        a feed keeps the order (text, then the call it opens; a call, then the text after)."""
        if self.reader.calls is None or len(text) < 2:
            return [text]
        fmt = self.reader.format
        cuts = set()
        for marker in (m for m in (fmt.open, fmt.close) if m):
            at = text.find(marker)
            while at != -1:
                cuts |= {at, at + len(marker)}
                at = text.find(marker, at + 1)
        cuts = sorted(c for c in cuts if 0 < c < len(text))
        if not cuts:
            return [text]
        return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]

    def _feed(self, text: str, finished: bool) -> list[PartEvent]:
        delta = self.reader.delta(text, finished)
        events: list[PartEvent] = []
        if delta.get("reasoning_content"):  # the thinking comes before all else
            self._grow(REASONING, delta["reasoning_content"], events)
        entries = delta.get("tool_calls", ())
        # The calls already open go on first (a call ends before the text after it), the
        # text next, the calls it opens last.
        for entry in entries:
            if "id" not in entry:
                self._arguments(self._calls[entry["index"]], entry, events)
        if delta.get("content"):
            self._grow(TEXT, delta["content"], events)
        for entry in entries:
            if "id" in entry:
                part = self._start(CALL, events)
                part.call_id, part.name = entry["id"], entry["function"]["name"]
                self._calls[entry["index"]] = part
                events.append(PartEvent("open", part))
                self._arguments(part, entry, events)
        if finished:
            self._close(events)
        return events

    def _arguments(self, part: Part, entry: dict, events: list[PartEvent]) -> None:
        piece = entry.get("function", {}).get("arguments", "")
        if not piece:
            return
        part.text += piece
        if part is self._open:
            events.append(PartEvent("delta", part, piece))
        else:  # the reader finishes a call before it starts anything after it
            log.warning("arguments of call %s arrived after it closed", part.name)

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
