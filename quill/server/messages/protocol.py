"""Anthropic's Messages API request (`POST /v1/messages`, `/v1/messages/count_tokens`), typed
under quill's field policy (quill/server/fields.py), and its translation into the chat request
every API becomes.

Honoured: `system` (text or text blocks), `messages` with text, `tool_use`, `tool_result` and
`thinking` blocks, `tools` (client tools: name, description, input_schema), `tool_choice`
(auto, any, tool, none; `disable_parallel_tool_use`), `stop_sequences`, `max_tokens`,
`temperature`, `top_p`, `top_k` (which the 2026 SDK no longer sends, older clients do),
`thinking` (enabled with a budget, adaptive, disabled), `output_config` (effort as a thinking
budget, `format` a JSON schema through structured output), `metadata`, `stream`;
`cache_control` marks are accepted (quill caches every prefix by itself). Refused with a
400 naming the field: images, documents and other non-text blocks,
Anthropic's server tools (web search, code execution, ...), `mcp_servers`, `container`,
`context_management`.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, model_validator

from quill.contract.errors import InvalidRequestError
from quill.frontend.reasoning import EFFORT_BUDGETS
from quill.server.fields import Lenient, by_type, member, refused, unsupported


class TextBlock(Lenient):
    type: Literal["text"]
    text: str
    cache_control: dict | None = None
    citations: list | None = None


class ToolUseBlock(Lenient):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str
    input: dict
    cache_control: dict | None = None


class ToolResultBlock(Lenient):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: dict | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(block.text for block in self.content)


class ThinkingBlock(Lenient):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(Lenient):
    type: Literal["redacted_thinking"]
    data: str


OtherBlock = refused("OtherBlock", "content blocks", "messages")
Block = Annotated[
    member(TextBlock, "text")
    | member(ToolUseBlock, "tool_use")
    | member(ToolResultBlock, "tool_result")
    | member(ThinkingBlock, "thinking")
    | member(RedactedThinkingBlock, "redacted_thinking")
    | member(OtherBlock, "other"),
    by_type(("text", "tool_use", "tool_result", "thinking", "redacted_thinking")),
]


class Message(Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class ClientTool(Lenient):
    type: Literal["custom"] | None = None
    name: str
    description: str | None = None
    input_schema: dict
    cache_control: dict | None = None
    strict: bool | None = None

    def as_chat_tool(self) -> dict:
        function = {"name": self.name, "parameters": self.input_schema}
        if self.description is not None:
            function["description"] = self.description
        return {"type": "function", "function": function}


# Anthropic's server tools (web search, code execution, ...) run on Anthropic's side.
ServerTool = refused("ServerTool", "tools", "tools", " (client tools only)")
ToolSpec = Annotated[
    member(ClientTool, "custom") | member(ServerTool, "server"),
    by_type(("custom",), missing="custom", other="server"),  # client tools may leave it out
]


class ToolChoice(Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1, le=2**63 - 1)
    display: str | None = None


class Metadata(Lenient):
    user_id: str | None = None


class OutputFormat(Lenient):
    type: Literal["json_schema"]
    schema_: dict = Field(alias="schema")


class OutputConfig(Lenient):
    """How much effort (thinking) the reply may spend, and the JSON schema it follows."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class CountTokensRequest(Lenient):
    """The body of /v1/messages/count_tokens: a message request without its sampling."""

    model: str | None = None
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    # Accepted: quill caches every prefix by itself.
    cache_control: dict | None = None
    # Known, and asking for what quill does not do.
    mcp_servers: list | None = None
    container: str | dict | None = None
    context_management: dict | None = None

    @model_validator(mode="after")
    def _check(self):
        for name in ("mcp_servers", "container", "context_management"):
            if getattr(self, name):
                raise unsupported(f"{name} is", name)
        if self.tool_choice is not None and self.tool_choice.type == "tool":
            if not self.tool_choice.name:
                raise InvalidRequestError("tool_choice of type tool needs a name",
                                          param="tool_choice")  # fmt: skip
        return self

    def chat_request(self) -> dict:
        """The chat completions request this one is (its body, before validation)."""
        messages = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else _joined(self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += _chat_messages(message)
        body: dict = {"model": self.model, "messages": messages}
        if self.tools:
            body["tools"] = [t.as_chat_tool() for t in self.tools]
        choice = self.tool_choice
        if choice is not None and self.tools:
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
                choice.type, {"type": "function", "function": {"name": choice.name}}
            )
        # Claude replies with several calls unless told not to.
        body["parallel_tool_calls"] = not (choice is not None and choice.disable_parallel_tool_use)
        thinking = self.thinking
        if thinking is not None:
            if thinking.type == "disabled":
                body["reasoning_effort"] = "none"
            else:
                body["chat_template_kwargs"] = {"enable_thinking": True}
                body["thinking_token_budget"] = thinking.budget_tokens
        config = self.output_config
        if config is not None and config.effort is not None:
            if body.get("thinking_token_budget") is None:
                body["thinking_token_budget"] = EFFORT_BUDGETS[config.effort]
        if config is not None and config.format is not None:
            spec = {"name": "output", "schema": config.format.schema_}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        return {k: v for k, v in body.items() if v is not None}


class MessagesRequest(CountTokensRequest):
    max_tokens: int = Field(ge=1, le=2**63 - 1)
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, le=2**63 - 1)
    ignore_eos: bool | None = None  # vLLM's extension (benchmarks ask for fixed lengths)
    metadata: Metadata | None = None
    # Accepted: they change nothing about what is generated.
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    diagnostics: dict | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None

    def chat_request(self) -> dict:
        body = super().chat_request()
        body |= {"max_tokens": self.max_tokens, "stop": self.stop_sequences,
                 "temperature": self.temperature, "top_p": self.top_p,
                 "top_k": self.top_k, "ignore_eos": self.ignore_eos}  # fmt: skip
        return {k: v for k, v in body.items() if v is not None}


# The chat request's fields, as this API names them (for the errors its validation raises).
CHAT_PARAMS = {
    "prompt": "messages",
    "stop": "stop_sequences",
    "thinking_token_budget": "thinking",
    "reasoning_effort": "thinking",
    "chat_template_kwargs": "thinking",
    "response_format": "output_config.format",
}


def _joined(blocks: list[TextBlock]) -> str:
    return "\n".join(block.text for block in blocks)


def _chat_messages(message: Message) -> list[dict]:
    """One Messages API turn as chat messages: a user turn's tool results each a tool message
    (before the turn's text), an assistant turn's text, calls and thinking one message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    blocks = message.content
    texts = [b.text for b in blocks if isinstance(b, TextBlock)]
    if message.role == "user":
        for b in blocks:
            if not isinstance(b, TextBlock | ToolResultBlock):
                raise InvalidRequestError(f"a user message cannot hold {b.type} blocks",
                                          param="messages")  # fmt: skip
        out = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
               for b in blocks if isinstance(b, ToolResultBlock)]  # fmt: skip
        if texts or not out:
            out.append({"role": "user", "content": "\n".join(texts)})
        return out
    turn: dict = {"role": "assistant", "content": "".join(texts)}
    calls = []
    for b in blocks:
        if isinstance(b, ToolResultBlock):
            raise InvalidRequestError("tool_result blocks belong in user messages",
                                      param="messages")  # fmt: skip
        if isinstance(b, ThinkingBlock):
            turn["reasoning_content"] = b.thinking
        if isinstance(b, ToolUseBlock):
            arguments = json.dumps(b.input, ensure_ascii=False)
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": arguments}})  # fmt: skip
    if calls:
        turn["tool_calls"] = calls
    return [turn]
