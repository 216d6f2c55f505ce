"""The Responses API's request (`POST /v1/responses`), typed under quill's field policy
(quill/server/fields.py), and its translation into the chat request every API becomes.

What is honoured: `input` as text or items (messages with text parts, `function_call`,
`function_call_output`, `reasoning`), `instructions`, function `tools`, `tool_choice`,
`parallel_tool_calls`, `text.format` (json_schema, json_object), `max_output_tokens`,
`temperature`, `top_p`, `top_logprobs`, `reasoning` (effort, summary), `metadata`, `store`,
`include`, `previous_response_id`, `background`, `stream`; vLLM's sampling extensions (top_k,
min_p, repetition_penalty, seed, priority, cache_salt, chat_template_kwargs, ignore_eos)
ride along as in chat completions. What asks for something quill does not do (built-in
tools, images and files, `conversation`, stored `prompt` templates, `truncation: "auto"`,
`max_tool_calls`) is a 400 naming the field.
"""

from __future__ import annotations

import base64
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, model_validator

from quill.contract.errors import InvalidRequestError
from quill.frontend.reasoning import EFFORT_BUDGETS
from quill.server.fields import (
    Count,
    Int64,
    Lenient,
    by_type,
    limits_of,
    member,
    refused,
    unsupported,
)

# What `include` may ask for: the two quill fills in, and the outputs of OpenAI's built-in
# tools, which quill never runs (so there is nothing of theirs to include).
INCLUDABLE = {
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
}
# quill does not encrypt: a reasoning item's `encrypted_content` carries the thinking itself,
# so that a client keeping no state (store false) can give it back with the next turn.
_THINKING_PREFIX = "quill-thinking:"


def pack_thinking(text: str) -> str:
    return _THINKING_PREFIX + base64.b64encode(text.encode()).decode()


def unpack_thinking(value: str | None) -> str | None:
    """The thinking in an `encrypted_content` quill wrote (None for another server's)."""
    if not value or not value.startswith(_THINKING_PREFIX):
        return None
    try:
        return base64.b64decode(value[len(_THINKING_PREFIX) :], validate=True).decode()
    except ValueError:
        return None


# -- input items ------------------------------------------------------------------------
class TextContent(Lenient):
    # input_text in user turns, output_text in assistant turns given back.
    type: Literal["input_text", "output_text"]
    text: str


class RefusalContent(Lenient):
    type: Literal["refusal"]
    refusal: str


# Images, files, audio: a language model server has no use for them.
OtherContent = refused("OtherContent", "content", "input")
Content = Annotated[
    member(TextContent, "input_text")
    | member(TextContent, "output_text")
    | member(RefusalContent, "refusal")
    | member(OtherContent, "other"),
    by_type(("input_text", "output_text", "refusal")),
]


def _text_of(content: str | list) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text if isinstance(p, TextContent) else p.refusal for p in content)


class MessageItem(Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(Lenient):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(Lenient):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[Content]
    id: str | None = None
    status: str | None = None


class SummaryText(Lenient):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Lenient):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Lenient):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = []
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: str | None = None

    def thinking(self) -> str | None:
        """The thinking the item carries: its text, else quill's own encrypted_content, else
        its summary (None: nothing to give the template)."""
        if self.content:
            return "".join(c.text for c in self.content)
        unpacked = unpack_thinking(self.encrypted_content)
        if unpacked is not None:
            return unpacked
        return "\n".join(s.text for s in self.summary) or None


OtherItem = refused("OtherItem", "input items", "input")
InputItem = Annotated[
    member(MessageItem, "message")
    | member(FunctionCallItem, "function_call")
    | member(FunctionCallOutputItem, "function_call_output")
    | member(ReasoningItem, "reasoning")
    | member(OtherItem, "other"),
    # A message may leave its type out.
    by_type(("message", "function_call", "function_call_output", "reasoning"), "message"),
]


# -- tools, formats, reasoning ----------------------------------------------------------
class FunctionTool(Lenient):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "description": self.description,
                    "parameters": self.parameters, "strict": self.strict}  # fmt: skip
        given = {k: v for k, v in function.items() if v is not None}
        return {"type": "function", "function": given}


OtherTool = refused("OtherTool", "tools", "tools", " (function tools only)")
ToolSpec = Annotated[
    member(FunctionTool, "function") | member(OtherTool, "other"), by_type(("function",))
]


class FunctionChoice(Lenient):
    type: Literal["function"]
    name: str


class TextFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None

    def as_response_format(self) -> dict:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name or "output", "schema": self.schema_, "strict": self.strict}
        given = {k: v for k, v in spec.items() if v is not None}
        return {"type": "json_schema", "json_schema": given}


class TextConfig(Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name


class StreamOptions(Lenient):
    include_obfuscation: bool | None = None  # padding against length side channels: none here


# -- the request ------------------------------------------------------------------------
class ResponsesRequest(Lenient):
    model: str | None = None
    input: str | list[InputItem] = Field(default_factory=list)
    instructions: str | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=2**63 - 1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    reasoning: ReasoningConfig | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = True
    include: list[str] | None = None
    previous_response_id: str | None = None
    background: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Known, and asking for what quill does not do (refused when they ask for anything).
    conversation: str | dict | None = None
    prompt: dict | None = None
    max_tool_calls: int | None = None
    context_management: list | dict | None = None
    # Accepted: they change nothing about what is generated.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict | None = None
    service_tier: str | None = None
    # vLLM's extensions, as in chat completions.
    top_k: int | None = Field(None, ge=-1, le=2**63 - 1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: Int64 | None = None
    priority: Int64 | None = 0
    cache_salt: str | None = Field(None, min_length=1)
    chat_template_kwargs: dict | None = None
    thinking_token_budget: Count | None = None
    ignore_eos: bool | None = None

    @model_validator(mode="after")
    def _check(self, info: ValidationInfo):
        limits = limits_of(info)
        for name in ("conversation", "prompt", "max_tool_calls", "context_management"):
            if getattr(self, name) is not None:
                raise unsupported(f"{name} is", name)
        if self.truncation == "auto":
            raise InvalidRequestError('truncation "auto" is not supported (a conversation past '
                                      "the context is refused, not cut)", "truncation")  # fmt: skip
        if self.text is not None and self.text.verbosity not in (None, "medium"):
            raise unsupported("text.verbosity other than medium is", "text.verbosity")
        unknown = sorted(set(self.include or ()) - INCLUDABLE)
        if unknown:
            raise InvalidRequestError(f"include: unknown value {unknown[0]!r}", param="include")
        if self.background and not self.store:
            raise InvalidRequestError("background responses must be stored (store: true)",
                                      param="background")  # fmt: skip
        if self.background and self.stream:
            raise unsupported("streaming a background response is", "background")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError("stream_options is only allowed when stream is true",
                                      param="stream_options")  # fmt: skip
        if self.metadata is not None and len(self.metadata) > 16:
            raise InvalidRequestError("metadata holds at most 16 keys", param="metadata")
        if isinstance(self.input, list) and not self.input and self.previous_response_id is None:
            raise InvalidRequestError("input must not be empty", param="input")
        if self.chat_template_kwargs is not None:
            limits.check_value(self.chat_template_kwargs, "chat_template_kwargs",
                               "chat_template_kwargs")  # fmt: skip
        return self

    @property
    def logprobs_asked(self) -> bool:
        return "message.output_text.logprobs" in (self.include or ())

    @property
    def summary_asked(self) -> bool:
        r = self.reasoning
        return r is not None and (r.summary or r.generate_summary) is not None

    def input_messages(self) -> list[dict]:
        """`input` as chat messages (the instructions and earlier turns not included)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        return items_to_messages(self.input)

    def chat_request(self, history: list[dict]) -> dict:
        """The chat completions request this one is (its body, before validation), after the
        conversation `history` (earlier turns, as chat messages)."""
        messages = list(history) + self.input_messages()
        if self.instructions is not None:
            messages.insert(0, {"role": "system", "content": self.instructions})
        body: dict = {
            "model": self.model,
            "messages": messages,
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "priority": self.priority,
            "cache_salt": self.cache_salt,
            "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.chat_template_kwargs,
            "thinking_token_budget": self.thinking_token_budget,
            "ignore_eos": self.ignore_eos,
        }
        if self.tools:
            body["tools"] = [t.as_chat_tool() for t in self.tools]
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        elif choice is not None:
            body["tool_choice"] = choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.as_response_format()
        if self.logprobs_asked:
            body |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        effort = self.reasoning.effort if self.reasoning is not None else None
        if effort == "none":
            body["reasoning_effort"] = "none"
        elif effort is not None and self.thinking_token_budget is None:
            body["thinking_token_budget"] = EFFORT_BUDGETS[effort]
        return {k: v for k, v in body.items() if v is not None}


# The chat request's fields, as this API names them (for the errors its validation raises).
CHAT_PARAMS = {
    "messages": "input",
    "prompt": "input",
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "thinking_token_budget": "reasoning",
    "logprobs": "include",
}


def items_to_messages(items: list) -> list[dict]:
    """Input items as chat messages: an assistant's text and the calls after it one message,
    each call's output a tool message, a reasoning item's thinking on the assistant turn that
    follows it."""
    messages: list[dict] = []
    thinking: str | None = None

    def assistant(new: bool) -> dict:
        nonlocal thinking
        last = messages[-1] if messages else None
        if new or last is None or last["role"] != "assistant":
            last = {"role": "assistant", "content": ""}
            messages.append(last)
        if thinking is not None:
            last["reasoning_content"] = thinking
            thinking = None
        return last

    for item in items:
        if isinstance(item, ReasoningItem):
            thinking = item.thinking()
        elif isinstance(item, MessageItem):
            text = _text_of(item.content)
            if item.role == "assistant":
                assistant(new=True)["content"] = text
            else:
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            assistant(new=False).setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            output = _text_of(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages
