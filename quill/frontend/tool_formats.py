"""Tool calls in the model's own format: how each family writes a call, the reader that finds
the calls in a reply as it streams, and the grammar that makes a reply one (or more) calls.

A model whose chat template renders `tools` was trained to answer in that template's format,
and calls tools less reliably in any other. The formats (vLLM's `--tool-call-parser` names):

- `hermes` (Qwen2.5, Qwen3, Hermes, many fine-tunes): `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`, one block a call, text allowed before.
- `llama3_json` (Llama 3.1-3.3): the whole reply is `{"name": ..., "parameters": {...}}`,
  optionally after `<|python_tag|>`, calls separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`.
- `generic`: quill's own JSON shape for templates that know no tools (quill/frontend/tools.py).

Each reader takes the reply's text in pieces and says, at any point, the text answer that is
safe to show (never a marker still forming, never call JSON) and the calls begun: name once
whole, arguments as the JSON text written so far. The stream and the whole reply are read by
the same reader, so the deltas join into exactly the whole reply's calls.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from quill.contract.constraint import Constraint
from quill.frontend.json_spans import JsonSpans
from quill.frontend.reasoning import partial_suffix
from quill.frontend.tools import Function, ToolChoice, ToolReply, reply_constraint
from quill.structured.schema import bounded_numbers

ARGUMENT_KEYS = ("arguments", "parameters")


class MarkedCalls:
    """Calls written as JSON values after an opening marker amid text: one object each
    (`array` False: hermes, llama3_json) or an array of them (mistral). `close` ends a call
    block where the format has one; `separator` may stand between blocks (llama3's ';')."""

    def __init__(self, open_: str, close: str = "", array: bool = False, separator: str = "",
                 at_start: bool = False, special: tuple[str, ...] = ()) -> None:  # fmt: skip
        self.open = open_
        self.close = close
        self.array = array
        self.separator = separator
        # llama3_json: a reply that begins with '{' is a call without the marker.
        self.at_start = at_start
        # Markers that are special tokens: never shown as text (a call that broke off leaves
        # its text to the content, as skip_special_tokens would have left it).
        self.special = special
        self.text = ""
        self.pos = 0  # how far the text has been read
        self.state = "start" if at_start else "text"
        self.outside = ""  # text outside the calls, read so far
        self.blocks: list[JsonSpans] = []
        self.block_starts: list[int] = []  # where each block's marker begins
        self.broken_at: int | None = None  # where call JSON stopped being JSON
        self.finished = False

    # -- reading ----------------------------------------------------------------------------
    def feed(self, piece: str) -> None:
        self.text += piece
        self._read()

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

    def _read(self) -> None:
        while self.broken_at is None:
            before = (self.state, self.pos)
            getattr(self, f"_{self.state}")()
            if (self.state, self.pos) == before:
                return

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
        found = self.text.find(self.open, self.pos)
        if found >= 0:
            self.outside += self.text[self.pos : found]
            self.pos = found + len(self.open)
            self._begin_call(found)
            return
        keep = partial_suffix(self.text[self.pos :], self.open)
        self.outside += self.text[self.pos : len(self.text) - keep]
        self.pos = len(self.text) - keep

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


@dataclass(frozen=True)
class ToolFormat:
    """One family's way of writing tool calls."""

    name: str
    renders_tools: bool  # the chat template offers the tools (else quill's system text)
    open: str = ""
    close: str = ""
    array: bool = False
    separator: str = ""
    at_start: bool = False
    arguments_key: str = "arguments"
    # Markers that are special tokens in the family's tokenizer: the text must keep them.
    special_markers: tuple[str, ...] = ()
    # Mistral's templates take only 9-character alphanumeric call ids back in the history.
    short_call_ids: bool = False

    def call_id(self) -> str:
        """A fresh id for a call the reply made, of the shape the template takes back."""
        return uuid.uuid4().hex[:9] if self.short_call_ids else f"call_{uuid.uuid4().hex[:24]}"

    def reader(self):
        if self.name == "generic":
            return GenericCalls()
        return MarkedCalls(self.open, self.close, self.array, self.separator, self.at_start,
                           self.special_markers)  # fmt: skip

    def constraint(self, functions: list[Function], choice: ToolChoice, literal) -> Constraint:
        """The grammar of a reply under `choice` "required" or "named" (the generic format
        also serves "auto": its answers are JSON too). `literal(text)` writes a marker as the
        grammar takes it (a special token by id)."""
        if self.name == "generic":
            return reply_constraint(functions, choice)
        chosen = [f for f in functions if choice.mode != "named" or f.name == choice.name]
        rules = []
        for i, f in enumerate(chosen):
            schema = {
                "type": "object",
                "properties": {"name": {"const": f.name},
                               self.arguments_key: bounded_numbers(f.arguments_schema)},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
                "x-guidance": {"whitespace_flexible": False, "lenient": True},
            }  # fmt: skip
            rules.append(f"call{i}: %json{json.dumps(schema, separators=(',', ':'))}")
        call = "call: " + " | ".join(f"call{i}" for i in range(len(chosen)))
        many = choice.parallel and choice.mode != "named"
        if self.array:
            one = "call"
            body = f'{literal(self.open)} "[" call ("," call)* "]"' if many else \
                f'{literal(self.open)} "[" call "]"'  # fmt: skip
        else:
            opener = literal(self.open) + ' "\\n" ' if self.open and not self.at_start else ""
            closer = ' "\\n" ' + literal(self.close) if self.close else ""
            one = f"{opener}call{closer}"
            joiner = '"\\n"' if not self.separator else json.dumps(self.separator)
            body = f"block ({joiner} block)*" if many else "block"
        lines = [f"start: {body}", f"block: {one}", call, *rules]
        return Constraint("grammar", "\n".join(lines) + "\n")


FORMATS = {
    f.name: f
    for f in (
        ToolFormat("generic", renders_tools=False),
        ToolFormat("hermes", True, open="<tool_call>", close="</tool_call>"),
        ToolFormat("llama3_json", True, open="<|python_tag|>", separator=";", at_start=True,
                   arguments_key="parameters", special_markers=("<|python_tag|>",)),
        ToolFormat("mistral", True, open="[TOOL_CALLS]", array=True,
                   special_markers=("[TOOL_CALLS]",), short_call_ids=True),
    )
}  # fmt: skip


def detect_tool_format(template: str | None) -> ToolFormat:
    """The format a chat template's tool rendering asks for (generic when it renders none)."""
    if not template or not re.search(r"\btools\b", template):
        return FORMATS["generic"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return FORMATS["mistral"]
    if "<|python_tag|>" in template or "<|eom_id|>" in template or '"parameters"' in template:
        return FORMATS["llama3_json"]
    return FORMATS["generic"]
