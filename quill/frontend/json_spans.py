"""Where the values of a JSON text lie, read as the text grows: the tool-call parser's scanner.

A streamed reply arrives a few characters at a time, and a tool call's id and name must go out
as soon as they are whole, its arguments as they come. `JsonSpans` reads each character once
and records, for every value no deeper than `max_depth`, the span of text it covers (its end
still open while it is being written): the path ("tool_calls", 0, "arguments") names the
arguments of the first call. The text is taken to be a prefix of one JSON value (a grammar
made it); at the first character that breaks JSON the scanner stops and says so (`broken`).
"""

from __future__ import annotations

import json

Path = tuple[str | int, ...]

_WHITESPACE = " \t\r\n"
# After a scalar (number, true, false, null) one of these shows where it ended.
_SCALAR_END = ",]}" + _WHITESPACE


class _Container:
    """An object or array being read: its path, and what may come next in it."""

    __slots__ = ("kind", "path", "expect", "key", "index")

    def __init__(self, kind: str, path: Path) -> None:
        self.kind = kind  # "{" or "["
        self.path = path
        self.expect = "key_or_end" if kind == "{" else "value_or_end"
        self.key: str | None = None
        self.index = -1

    def child(self) -> Path:
        return (*self.path, self.key if self.kind == "{" else self.index)


class JsonSpans:
    """Spans of the values of one JSON text, fed in pieces. `spans[path]` is [start, end] in
    the text (end None while the value is still being written)."""

    def __init__(self, max_depth: int = 3) -> None:
        self.max_depth = max_depth
        self.text = ""
        self.spans: dict[Path, list] = {}
        self.broken = False
        self.done = False  # the top-level value is whole
        self._stack: list[_Container] = []
        self._string: Path | None = None  # path of the string being read (None: not in one)
        self._key_start: int | None = None  # where the object key being read began
        self._escaped = False
        self._scalar: Path | None = None

    def feed(self, piece: str) -> None:
        start = len(self.text)
        self.text += piece
        for offset in range(start, len(self.text)):
            if self.broken:
                return
            self._char(self.text[offset], offset)

    def value(self, path: Path) -> str | None:
        """The text of the value at `path` so far (None if it has not begun)."""
        span = self.spans.get(path)
        if span is None:
            return None
        return self.text[span[0] : span[1]]

    def is_whole(self, path: Path) -> bool:
        span = self.spans.get(path)
        return span is not None and span[1] is not None

    # -- the scanner ------------------------------------------------------------------------

    def _char(self, c: str, offset: int) -> None:
        if self._string is not None or self._key_start is not None:
            self._in_string(c, offset)
            return
        if self._scalar is not None:
            if c not in _SCALAR_END:
                return
            self._end(self._scalar, offset)
            self._scalar = None
        if c in _WHITESPACE:
            return
        top = self._stack[-1] if self._stack else None
        if top is None:
            if self.done:
                self.broken = True  # a second value after the first
            else:
                self._begin((), c, offset)
        elif top.expect in ("value", "value_or_end"):
            if c == "]" and top.expect == "value_or_end":
                self._close(top, offset)
            else:
                if top.kind == "[":
                    top.index += 1
                self._begin(top.child(), c, offset)
        elif top.expect in ("key", "key_or_end"):
            if c == "}" and top.expect == "key_or_end":
                self._close(top, offset)
            elif c == '"':
                self._key_start = offset
            else:
                self.broken = True
        elif top.expect == "colon":
            if c == ":":
                top.expect = "value"
            else:
                self.broken = True
        elif c == ",":  # top.expect == "comma_or_end"
            top.expect = "key" if top.kind == "{" else "value"
        elif c == ("}" if top.kind == "{" else "]"):
            self._close(top, offset)
        else:
            self.broken = True

    def _in_string(self, c: str, offset: int) -> None:
        if self._escaped:
            self._escaped = False
        elif c == "\\":
            self._escaped = True
        elif c == '"':
            if self._key_start is not None:
                top = self._stack[-1]
                top.key = json.loads(self.text[self._key_start : offset + 1])
                top.expect = "colon"
                self._key_start = None
            else:
                path, self._string = self._string, None
                self._end(path, offset + 1)

    def _begin(self, path: Path, c: str, offset: int) -> None:
        if len(path) <= self.max_depth:
            self.spans[path] = [offset, None]
        if c in "{[":
            self._stack.append(_Container(c, path))
        elif c == '"':
            self._string = path
        elif c in "-0123456789tfn":
            self._scalar = path
        else:
            self.broken = True

    def _close(self, container: _Container, offset: int) -> None:
        self._stack.pop()
        self._end(container.path, offset + 1)

    def _end(self, path: Path, end: int) -> None:
        if path in self.spans:
            self.spans[path][1] = end
        if self._stack:
            self._stack[-1].expect = "comma_or_end"
        else:
            self.done = True

    def finish(self) -> None:
        """The text has ended: a number at its very end is whole."""
        if self._scalar is not None:
            self._end(self._scalar, len(self.text))
            self._scalar = None


def string_prefix(raw: str) -> str:
    """The decoded text of a JSON string literal's opening part (`raw` starts at its quote),
    up to its last complete character: an escape cut short is left for later."""
    body = raw[1:]
    if body.endswith('"') and _closes(body):
        return json.loads(raw)
    cut = len(body)
    i = 0
    while i < len(body):  # find where a trailing, unfinished escape begins
        if body[i] == "\\":
            need = 6 if body[i + 1 : i + 2] == "u" else 2
            if i + need > len(body):
                cut = i
                break
            if need == 6 and 0xD800 <= int(body[i + 2 : i + 6], 16) <= 0xDBFF:
                need = 12  # a high surrogate: its low half must come too
                if i + need > len(body):
                    cut = i
                    break
            i += need
        else:
            i += 1
    return json.loads('"' + body[:cut] + '"')


def _closes(body: str) -> bool:
    """Whether the final quote of `body` is unescaped (an even run of backslashes before it)."""
    run = len(body) - 1 - len(body[:-1].rstrip("\\"))
    return run % 2 == 0
