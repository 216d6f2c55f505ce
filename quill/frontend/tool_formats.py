"""Tool calls in the model's own format: how each family writes a call, and the grammar that
makes a reply one (or more) calls.

A model whose chat template renders `tools` was trained to answer in that template's format,
and calls tools less reliably in any other. The formats (vLLM's `--tool-call-parser` names):

- `hermes` (Qwen2.5, Qwen3, Hermes, many fine-tunes): `<tool_call>\\n{"name": ...,
  "arguments": {...}}\\n</tool_call>`, one block a call, text allowed before.
- `llama3_json` (Llama 3.1-3.3): the reply is `{"name": ..., "parameters": {...}}`, or text
  then `<|python_tag|>` and the call; calls separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or, where the template
  writes the newer form (v11 tokenizers on), `[TOOL_CALLS]name[ARGS]{...}` a call.
- `generic`: quill's own JSON shape for templates that know no tools (quill/frontend/tools.py).

Each format names its reader (quill/frontend/tool_readers.py) and makes the grammar of
"required" and named calls in its own markers.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from quill.contract.constraint import Constraint
from quill.frontend.tool_readers import GenericCalls, MarkedCalls, NamedArgsCalls
from quill.frontend.tools import Function, ToolChoice, reply_constraint
from quill.structured.schema import bounded_numbers


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
    # Mistral's newer form: the name in text, then this marker, then the arguments.
    args_marker: str = ""

    def call_id(self) -> str:
        """A fresh id for a call the reply made, of the shape the template takes back."""
        return uuid.uuid4().hex[:9] if self.short_call_ids else f"call_{uuid.uuid4().hex[:24]}"

    def reader(self):
        if self.name == "generic":
            return GenericCalls()
        if self.args_marker:
            return NamedArgsCalls(self.open, self.args_marker, self.special_markers)
        return MarkedCalls(self.open, self.close, self.array, self.separator, self.at_start,
                           self.special_markers)  # fmt: skip

    def constraint(self, functions: list[Function], choice: ToolChoice, literal) -> Constraint:
        """The grammar of a reply under `choice` "required" or "named" (the generic format
        also serves "auto": its answers are JSON too). `literal(text)` writes a marker as the
        grammar takes it (a special token by id)."""
        if self.name == "generic":
            return reply_constraint(functions, choice)
        chosen = [f for f in functions if choice.mode != "named" or f.name == choice.name]
        many = choice.parallel and choice.mode != "named"
        if self.args_marker:
            return self._named_args_constraint(chosen, many, literal)
        rules = []
        for i, f in enumerate(chosen):
            schema = _compact({
                "type": "object",
                "properties": {"name": {"const": f.name}, self.arguments_key: f.arguments_schema},
                "required": ["name", self.arguments_key],
                "additionalProperties": False,
            })  # fmt: skip
            rules.append(f"call{i}: %json{json.dumps(schema, separators=(',', ':'))}")
        call = "call: " + " | ".join(f"call{i}" for i in range(len(chosen)))
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

    def _named_args_constraint(self, chosen: list[Function], many: bool, literal) -> Constraint:
        rules = [
            f"call{i}: {json.dumps(f.name)} {literal(self.args_marker)} "
            f"%json{json.dumps(_compact(f.arguments_schema), separators=(',', ':'))}"
            for i, f in enumerate(chosen)
        ]
        lines = [
            "start: block+" if many else "start: block",
            f"block: {literal(self.open)} call",
            "call: " + " | ".join(f"call{i}" for i in range(len(chosen))),
            *rules,
        ]
        return Constraint("grammar", "\n".join(lines) + "\n")


def _compact(schema: dict) -> dict:
    """A schema as the grammars here embed it: numbers bounded, no free whitespace."""
    options = {"whitespace_flexible": False, "lenient": True}
    return {**bounded_numbers(schema), "x-guidance": options}


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
# The same parser name reads Mistral's newer form where the template writes it.
MISTRAL_NAMED_ARGS = ToolFormat("mistral", True, open="[TOOL_CALLS]", args_marker="[ARGS]",
                                special_markers=("[TOOL_CALLS]", "[ARGS]"),
                                short_call_ids=True)  # fmt: skip


def named_tool_format(name: str, template: str | None) -> ToolFormat:
    """The format `--tool-call-parser name` asks for, in the form the template writes."""
    if name == "mistral" and template and "[ARGS]" in template:
        return MISTRAL_NAMED_ARGS
    return FORMATS[name]


def detect_tool_format(template: str | None) -> ToolFormat:
    """The format a chat template's tool rendering asks for (generic when it renders none)."""
    if not template or not re.search(r"\btools\b", template):
        return FORMATS["generic"]
    if "<tool_call>" in template:
        return FORMATS["hermes"]
    if "[TOOL_CALLS]" in template:
        return MISTRAL_NAMED_ARGS if "[ARGS]" in template else FORMATS["mistral"]
    if "<|python_tag|>" in template or "<|eom_id|>" in template or '"parameters"' in template:
        return FORMATS["llama3_json"]
    return FORMATS["generic"]
