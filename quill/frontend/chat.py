"""A conversation as the engine takes it, in the served model's own words: the one place every
chat API maps messages, tools and reasoning onto a prompt, a constraint and sampling limits.

`ChatFormat` is chosen once per model from its chat template (or the flags): the tool format
(quill/frontend/tool_formats.py) and the reasoning format (quill/frontend/reasoning.py), plus
the server's default template arguments. `prepare_chat` renders one conversation:

- a template that renders tools gets them, and the earlier calls (arguments as objects, as
  transformers' `apply_chat_template` documents them) and tool results, in its own format;
  a template that knows no tools gets quill's generic format (quill/frontend/tools.py);
- `chat_template_kwargs` (request over server defaults) reach the template: Qwen3's
  `enable_thinking` and the like;
- the reply's constraint: "required" and named tool choices in the model's own format (the
  generic format constrains "auto" too), else the request's structured output; on a reasoning
  model the constraint starts after the thinking ends;
- a thinking budget as the marker's token ids (the engine forces them once it is spent).
"""

from __future__ import annotations

import inspect
import json
import logging
from dataclasses import dataclass, field, replace

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.contract.sampling_params import SamplingParams
from quill.frontend.json_limits import DEFAULT_LIMITS, JsonLimits
from quill.frontend.reasoning import (
    REASONING_FORMATS,
    ReasoningFormat,
    detect_reasoning_format,
)
from quill.frontend.tool_formats import (
    FORMATS,
    ToolFormat,
    detect_tool_format,
    named_tool_format,
)
from quill.frontend.tools import Function, ToolChoice, render_conversation

log = logging.getLogger(__name__)

TOOL_PARSERS = ("auto", *FORMATS)
REASONING_PARSERS = ("auto", "none", *REASONING_FORMATS)


@dataclass(frozen=True)
class ChatFormat:
    """How the served model's conversations are written and its replies read."""

    tools: ToolFormat = FORMATS["generic"]
    reasoning: ReasoningFormat | None = None
    template_kwargs: dict = field(default_factory=dict)  # the server's defaults

    @classmethod
    def choose(
        cls,
        template: str | None,
        tool_parser: str = "auto",
        reasoning_parser: str = "auto",
        template_kwargs: dict | None = None,
    ) -> ChatFormat:
        """The formats the flags name, or (auto) the ones the template writes; logged."""
        if tool_parser not in TOOL_PARSERS:
            raise ValueError(f"tool call parser {tool_parser!r}: one of {', '.join(TOOL_PARSERS)}")
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"reasoning parser {reasoning_parser!r}: one of "
                             f"{', '.join(REASONING_PARSERS)}")  # fmt: skip
        if tool_parser == "auto":
            tools = detect_tool_format(template)
        else:
            tools = named_tool_format(tool_parser, template)
        if reasoning_parser == "auto":
            reasoning = detect_reasoning_format(template)
        else:
            reasoning = REASONING_FORMATS.get(reasoning_parser)
        how = "chosen from the chat template" if tool_parser == "auto" else "as asked"
        log.info("tool calls: the %s format (%s); reasoning: %s", tools.name, how,
                 reasoning.name if reasoning else "none")  # fmt: skip
        return cls(tools, reasoning, dict(template_kwargs or {}))


@dataclass
class ChatTurn:
    """One conversation ready for the engine, and how to read its reply."""

    prompt_ids: list[int]
    prompt_text: str
    tools: ToolFormat
    choice: ToolChoice | None  # how the reply uses the tools (None: plain text)
    reasoning: ReasoningFormat | None  # None: no thinking expected (no format, or turned off)
    opened: bool  # the prompt opened the thinking block: the reply begins inside it
    constraint: Constraint | None
    constraint_field: str | None
    thinking_end_ids: list[int] = field(default_factory=list)
    thinking_start_ids: list[int] = field(default_factory=list)
    keep_special_tokens: bool = False
    thinking_off: bool = False  # the model reasons, but the template turned it off

    def sampling_params(
        self, params: SamplingParams, thinking_budget: int | None
    ) -> SamplingParams:
        """`params` with the turn's constraint, thinking budget and special-token handling."""
        changes: dict = {"structured": self.constraint}
        if thinking_budget is not None and self.reasoning is None and not self.thinking_off:
            raise InvalidRequestError(
                "thinking_budget: this model does not reason (no reasoning format: see "
                "--reasoning-parser)",
                "thinking_budget",
            )
        if thinking_budget is not None and self.reasoning is not None:
            changes |= {"thinking_budget": thinking_budget,
                        "thinking_end_ids": self.thinking_end_ids,
                        "thinking_start_ids": self.thinking_start_ids}  # fmt: skip
        if self.keep_special_tokens:
            changes["skip_special_tokens"] = False
        return replace(params, **changes)


def prepare_chat(
    tokenizer,
    fmt: ChatFormat,
    messages: list[dict],
    functions: list[Function] | None = None,
    choice: ToolChoice | None = None,
    structured: Constraint | None = None,
    structured_field: str | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    limits: JsonLimits = DEFAULT_LIMITS,
) -> ChatTurn:
    """Render `messages` (OpenAI's shape: content as text, `tool_calls` with arguments as
    JSON text, `tool_call_id` on results) for the served model. Raises InvalidRequestError
    naming the field at fault."""
    kwargs = {**fmt.template_kwargs, **(template_kwargs or {})}
    reserved = sorted(set(kwargs) & _apply_parameters(tokenizer))
    if reserved:  # the call's own options (tokenize, chat_template, ...), not the template's
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                  "chat_template_kwargs")  # fmt: skip
    tools_format = fmt.tools
    offering = bool(functions) and choice is not None
    if tools_format.renders_tools:
        rendered = _template_messages(messages, limits)
        if offering:
            kwargs["tools"] = [{"type": "function", "function": f.offered()} for f in functions]
    else:
        try:
            rendered = render_conversation(messages, functions, choice, limits)
        except ValueError as e:
            raise InvalidRequestError(str(e), "messages") from e
    text = _apply_template(tokenizer, rendered, add_generation_prompt, kwargs)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)

    reasoning, opened, thinking_off = fmt.reasoning, False, False
    if reasoning is not None:
        opened = reasoning.opened_by(text)
        if not opened and reasoning.closed_by(text):
            reasoning, thinking_off = None, True  # the template closed the block
    constraint, constraint_field = structured, structured_field
    if offering and (not tools_format.renders_tools or choice.mode != "auto"):
        constraint = tools_format.constraint(functions, choice, _literal(tokenizer))
        constraint_field = "tools"
        if constraint.kind == "json_schema":
            # All the functions' schemas in one: a little deeper than each, as many $refs.
            together = replace(limits, max_json_depth=limits.max_json_depth + 8)
            together.check_value(json.loads(constraint.value), "tools",
                                 "the tools' schemas together")  # fmt: skip
    if constraint is not None and reasoning is not None:
        literal = _literal(tokenizer)
        start = "" if opened else literal(reasoning.start)
        constraint = replace(constraint, think_start=start, think_end=literal(reasoning.end))
    turn = ChatTurn(prompt_ids, text, tools_format, choice if offering else None, reasoning,
                    opened, constraint, constraint_field)  # fmt: skip
    if reasoning is not None:
        turn.thinking_end_ids = tokenizer.encode(reasoning.end, add_special_tokens=False)
        if not opened:
            turn.thinking_start_ids = tokenizer.encode(reasoning.start, add_special_tokens=False)
    turn.keep_special_tokens = offering and bool(tools_format.special_markers)
    turn.thinking_off = thinking_off
    return turn


def _apply_parameters(tokenizer) -> set[str]:
    """The names apply_chat_template takes for itself; the rest of its keyword arguments are
    the template's variables."""
    parameters = inspect.signature(tokenizer.hf.apply_chat_template).parameters
    return {"messages"} | {n for n, p in parameters.items() if p.kind is not p.VAR_KEYWORD}


def _template_messages(messages: list[dict], limits: JsonLimits) -> list[dict]:
    """Messages for a template that renders tools: each call's arguments as an object."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for call in m["tool_calls"]:
                fn = dict(call["function"])
                what = f"the arguments text of tool call {fn['name']!r}"
                try:
                    fn["arguments"] = limits.parse_text(fn["arguments"], "messages", what)
                except ValueError as e:
                    raise InvalidRequestError(str(e), "messages") from e
                calls.append({**call, "function": fn})
            m["tool_calls"] = calls
        out.append(m)
    return out


def _apply_template(tokenizer, messages: list[dict], add_generation_prompt: bool,
                    kwargs: dict) -> str:  # fmt: skip
    from quill.contract.errors import ModelLoadError

    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt, **kwargs)
    except ModelLoadError as e:
        raise InvalidRequestError(str(e), param="messages") from e
    except Exception as e:  # jinja raises for conversations its template does not allow
        raise InvalidRequestError(f"chat template error: {e}", param="messages") from e


def _literal(tokenizer):
    """How a grammar writes a marker: a token added to the vocabulary by its id (the grammar
    library reads every added token, special or not, as no text, and the model writes such a
    marker as that one token), anything else as its text."""
    added = tokenizer.added_tokens

    def literal(text: str) -> str:
        if text in added:
            return f"<[{added[text]}]>"
        return json.dumps(text)

    return literal
