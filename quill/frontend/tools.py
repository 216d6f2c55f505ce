"""Tool calls in quill's generic format: OpenAI's `tools` and `tool_choice` read (an
InvalidRequestError naming the field for anything wrong), the prompt that offers the tools, the
constraint that makes a reply one well-formed call (or answer), and the reply read back as calls.

SmolLM2's chat template, like many, knows nothing of tools, so quill writes them into the
system message itself and asks for one JSON object a reply (as llama.cpp's generic format
does): {"tool_calls": [{"name": ..., "arguments": {...}}, ...]} to call functions, or
{"response": "..."} to answer in text. The constraint (a JSON schema of that shape, each
function's own `parameters` as its arguments) makes every reply parse: `tool_choice` "auto"
allows both shapes, "required" only calls, a named function only one call of it. Earlier turns
are written in the same shape, so the model sees its own format in the conversation: calls as
that JSON, a tool's result as a user message {"tool_response": {"name", "content"}}.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.frontend.json_limits import DEFAULT_LIMITS, JsonLimits
from quill.frontend.json_spans import JsonSpans, string_prefix

# The grammar writes JSON without spaces; history is written the same way.
SEPARATORS = (",", ":")
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MODES = ("auto", "required", "named")


@dataclass(frozen=True)
class Function:
    name: str
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of an object; None: no arguments

    @property
    def arguments_schema(self) -> dict:
        """The schema of the call's arguments: without parameters, exactly {} (OpenAI's
        meaning of a function that declares none)."""
        if self.parameters is None:
            return {"type": "object", "properties": {}, "additionalProperties": False}
        return self.parameters

    def offered(self) -> dict:
        """How the prompt shows the function."""
        shown: dict = {"name": self.name}
        if self.description:
            shown["description"] = self.description
        shown["parameters"] = self.arguments_schema
        return shown


@dataclass(frozen=True)
class ToolChoice:
    """`mode` one of MODES; `name` the function a "named" choice calls."""

    mode: str = "auto"
    name: str | None = None
    parallel: bool = False  # whether a reply may call more than one function


def read_tools(
    tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool | None
) -> tuple[list[Function], ToolChoice | None]:
    """The functions offered and how the reply must use them (None: tools are not used, as
    with tool_choice "none"). `tools` as the request gave them (each {"type", "function"})."""
    if not tools:  # an empty list asks for nothing (clients send one; OpenAI refuses it)
        if tool_choice not in (None, "none", "auto"):
            raise InvalidRequestError(
                "tool_choice is only allowed when tools are specified", "tool_choice"
            )
        return [], None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", "tools")
    # One call a reply unless parallel_tool_calls asks for more (llama-server's default, not
    # OpenAI's): a small model asked for "one or more" calls tends to repeat its call until
    # max_tokens, and the reply then neither ends nor parses.
    parallel = parallel is True
    if tool_choice in (None, "auto", "required"):
        return functions, ToolChoice(tool_choice or "auto", parallel=parallel)
    if tool_choice == "none":
        return functions, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
            )
        return functions, ToolChoice("named", name, parallel=False)
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _function(tool: dict, index: int) -> Function:
    where = f"tools.{index}"
    if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where}: a tool must be {{"type": "function", '
                                  '"function": {...}}', "tools")  # fmt: skip
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string", "tools")
    parameters = fn.get("parameters")
    if parameters is not None and (
        not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
    ):
        raise InvalidRequestError(
            f"{where}.function.parameters must be a JSON schema of an object", "tools"
        )
    return Function(name, description, parameters)


def reply_constraint(functions: list[Function], choice: ToolChoice) -> Constraint:
    """The JSON schema every reply under `choice` satisfies."""
    chosen = [f for f in functions if choice.mode != "named" or f.name == choice.name]
    defs, calls = {}, []
    for i, f in enumerate(chosen):
        ref = f"quill_tool_{i}"
        defs[ref] = _rebased(f.arguments_schema, ref)
        calls.append(_object({"name": {"const": f.name}, "arguments": {"$ref": f"#/$defs/{ref}"}}))
    array: dict = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    array["minItems"] = 1
    if not choice.parallel or choice.mode == "named":
        array["maxItems"] = 1
    schema = _object({"tool_calls": array})
    if choice.mode == "auto":
        schema = {"anyOf": [schema, _object({"response": {"type": "string"}})]}
    return Constraint.json_schema({"$defs": defs, **schema})


def _object(properties: dict) -> dict:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties),
        "additionalProperties": False,
    }


def _rebased(schema, ref: str):
    """`schema` with its local references ("#/...") pointing into $defs/<ref>, where it goes."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = f"#/$defs/{ref}" + value[1:]
            elif key in ("const", "enum", "default", "examples"):
                out[key] = value  # data, not schemas
            else:
                out[key] = _rebased(value, ref)
        return out
    if isinstance(schema, list):
        return [_rebased(item, ref) for item in schema]
    return schema


def instructions(functions: list[Function], choice: ToolChoice) -> str:
    """The system-message text that offers the functions and asks for the reply's shape."""
    offered = _dump([f.offered() for f in functions])
    name = _dump(choice.name) if choice.mode == "named" else "<function name>"
    call = '{"tool_calls":[{"name":' + name + ',"arguments":<its arguments>}]}'
    which = "one or more of them" if choice.parallel else "one of them"
    if choice.mode == "named":
        ask = f"Call the function {choice.name}: reply with {call}."
    elif choice.mode == "required":
        ask = f"Call {which}: reply with {call}."
    else:
        ask = (
            f"To call {which}, reply with {call}; "
            'to answer without calling any, reply with {"response":<your answer>}.'
        )
    return (
        "You can call these functions (their parameters as JSON schemas):\n"
        f"{offered}\n"
        f"Reply with one JSON object and nothing else. {ask}"
    )


def render_conversation(
    messages: list[dict],
    functions: list[Function] | None,
    choice: ToolChoice | None,
    limits: JsonLimits = DEFAULT_LIMITS,
) -> list[dict]:
    """The messages as a template without tool support takes them (role and content only).

    `messages` in OpenAI's shape (content as text; `tool_calls` with arguments as JSON text;
    `tool_call_id` on tool results). With `functions` offered, their instructions join the
    system message and earlier text answers are written as {"response": ...}; calls and tool
    results are written in the format whether or not tools are offered now.
    Raises ValueError for a call whose arguments are not JSON (or past `limits`).
    """
    offering = bool(functions) and choice is not None
    names: dict[str, str] = {}  # tool call id -> function name, for the results
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = call["function"]
                names[call.get("id") or ""] = fn["name"]
                what = f"the arguments text of tool call {fn['name']!r}"
                arguments = limits.parse_text(fn["arguments"], "messages", what)
                calls.append({"name": fn["name"], "arguments": arguments})
            out.append({"role": "assistant", "content": _dump({"tool_calls": calls})})
        elif role == "assistant" and offering:
            out.append({"role": "assistant", "content": _dump({"response": content})})
        elif role == "tool":
            result = {"name": names.get(m.get("tool_call_id") or "", ""), "content": content}
            out.append({"role": "user", "content": _dump({"tool_response": result})})
        else:
            out.append({"role": role, "content": content})
    if offering:
        text = instructions(functions, choice)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + text}
        else:
            out.insert(0, {"role": "system", "content": text})
    return out


def _dump(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=SEPARATORS)


class ToolReply:
    """One reply in the format, read as it is written: the text answer so far, and the calls
    (name once whole, arguments as their JSON text so far). The same reading serves a stream
    and a whole reply, so the pieces streamed join into exactly the whole reply's calls."""

    def __init__(self) -> None:
        self.spans = JsonSpans(max_depth=3)

    def feed(self, text: str) -> None:
        self.spans.feed(text)

    def finish(self) -> None:
        self.spans.finish()

    @property
    def is_call(self) -> bool:
        return ("tool_calls",) in self.spans.spans

    def content(self) -> str | None:
        """The text answer so far (None if the reply is not one)."""
        raw = self.spans.value(("response",))
        return None if raw is None else string_prefix(raw)

    def calls(self) -> list[tuple[str | None, str]]:
        """(name, arguments text so far) of each call begun; name None until it is whole."""
        out = []
        index = 0
        while ("tool_calls", index) in self.spans.spans:
            name_path = ("tool_calls", index, "name")
            name = None
            if self.spans.is_whole(name_path):
                name = json.loads(self.spans.value(name_path))
            out.append((name, self.spans.value(("tool_calls", index, "arguments")) or ""))
            index += 1
        return out

    def unread(self) -> str | None:
        """The reply's text, if it is not in the format at all (a grammar would not allow it)."""
        if self.spans.broken or (not self.is_call and ("response",) not in self.spans.spans):
            return self.spans.text
        return None
