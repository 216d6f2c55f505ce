"""Ollama's API requests (`/api/chat`, `/api/generate`, `/api/embed`, `/api/embeddings`,
`/api/show`), typed under quill's field policy (quill/server/fields.py), and their translation
into the chat or completion request every API becomes.

`options` map onto sampling: temperature, top_p, top_k, min_p, seed, num_predict (max tokens;
-1 and -2: to the end of the context), stop, repeat_penalty (vLLM's repetition_penalty, over
the whole context: repeat_last_n may only be -1 or 64, Ollama's default, when it is set),
presence_penalty, frequency_penalty. Options that set up the runner (num_ctx, num_batch,
num_thread, num_gpu, use_mmap, ...) change nothing quill computes per request and are ignored
(the context is the served model's); sampling Ollama offers and quill does not (mirostat,
typical_p, tfs_z) is a 400 when it asks for something. `format` is "json" or a JSON schema
(structured output); `think` false turns thinking off where the template has the switch,
true or an effort level turns it on (an effort level sets a thinking budget). `images` and a
generate request's `context` are refused.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

from pydantic import Field, model_validator

from quill.contract.errors import InvalidRequestError
from quill.frontend.reasoning import EFFORT_BUDGETS
from quill.server.fields import Int64, Lenient

# Ollama's defaults for the options that have one the client may send back unchanged.
_NEUTRAL = {"mirostat": 0, "typical_p": 1.0, "tfs_z": 1.0}
_SAMPLING = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
             "min_p": "min_p", "seed": "seed", "stop": "stop",
             "repeat_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
             "frequency_penalty": "frequency_penalty"}  # fmt: skip
# The chat request's fields, as this API names them (for the errors its validation raises).
CHAT_PARAMS = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "stop": "options.stop",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "response_format": "format",
    "reasoning_effort": "think",
    "chat_template_kwargs": "think",
    "thinking_token_budget": "think",
}
_DURATION = re.compile(r"^(?:(\d+(?:\.\d+)?)(h|m|s|ms))+$")
_UNITS = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def keep_alive_seconds(value: float | str | None) -> float | None:
    """Ollama's keep_alive as seconds: a number of seconds or a Go duration ("5m", "1h30m");
    negative: forever (math.inf); None: the server's default."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        try:
            value = float(text)
        except ValueError:
            if not _DURATION.match(text.lstrip("-")):
                message = f'keep_alive {value!r} is not a duration (e.g. "5m", "30s", 0, -1)'
                raise InvalidRequestError(message, "keep_alive") from None
            total = sum(float(n) * _UNITS[u]
                        for n, u in re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s)", text))  # fmt: skip
            value = -total if text.startswith("-") else total
    if not math.isfinite(value):
        raise InvalidRequestError("keep_alive must be finite", "keep_alive")
    return math.inf if value < 0 else float(value)


class OllamaOptions(Lenient):
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Int64 | None = Field(None, ge=0)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: Int64 | None = None
    num_predict: Int64 | None = None
    stop: list[str] | str | None = None
    repeat_penalty: float | None = Field(None, gt=0, le=10)
    repeat_last_n: Int64 | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    mirostat: Int64 | None = None
    typical_p: float | None = None
    tfs_z: float | None = None
    # The runner's set-up: nothing per request changes with them.
    num_ctx: Int64 | None = None
    num_batch: Int64 | None = None
    num_thread: Int64 | None = None
    num_gpu: Int64 | None = None
    main_gpu: Int64 | None = None
    num_keep: Int64 | None = None
    use_mmap: bool | None = None
    use_mlock: bool | None = None
    numa: bool | None = None
    low_vram: bool | None = None
    penalize_newline: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        for name, neutral in _NEUTRAL.items():
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise InvalidRequestError(f"options.{name} is not supported",
                                          f"options.{name}")  # fmt: skip
        if self.repeat_last_n not in (None, -1, 64):
            raise InvalidRequestError("options.repeat_last_n: quill's repeat penalty covers the "
                                      "whole context (-1)", "options.repeat_last_n")  # fmt: skip
        return self

    def sampling(self) -> dict:
        """The chat / completion request's sampling fields."""
        body = {ours: getattr(self, theirs) for theirs, ours in _SAMPLING.items()}
        if self.num_predict is not None and self.num_predict >= 0:
            body["max_tokens"] = self.num_predict  # -1, -2: to the end of the context
        return {k: v for k, v in body.items() if v is not None}


class OllamaToolCallFunction(Lenient):
    name: str
    arguments: dict[str, Any] | str = Field(default_factory=dict)
    index: int | None = None


class OllamaToolCall(Lenient):
    function: OllamaToolCallFunction
    id: str | None = None


class OllamaMessage(Lenient):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[OllamaToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None

    def chat_message(self, index: int, call_ids: list[str]) -> dict:
        """As a chat completions message (`call_ids`: the ids given to the calls so far, so
        that a tool message answers the latest call of its name, or the latest call)."""
        if self.images:
            raise InvalidRequestError("images are not supported", f"messages.{index}.images")
        out: dict = {"role": self.role, "content": self.content or ""}
        if self.role == "assistant" and self.thinking:
            out["reasoning_content"] = self.thinking
        if self.role == "assistant" and self.tool_calls:
            calls = []
            for call in self.tool_calls:
                args = call.function.arguments
                call_id = call.id or f"call_{len(call_ids)}"
                call_ids.append(call_id)
                text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                function = {"name": call.function.name, "arguments": text}
                calls.append({"id": call_id, "type": "function", "function": function})
            out["tool_calls"] = calls
        if self.role == "tool":
            out["tool_call_id"] = self.tool_call_id or (call_ids[-1] if call_ids else "call_0")
        return out


class OllamaTool(Lenient):
    type: Literal["function"] = "function"
    function: dict


class OllamaBaseGenerate(Lenient):
    model: str = Field(min_length=1)
    stream: bool | None = True
    format: Literal["", "json"] | dict | None = None
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None
    think: bool | Literal["low", "medium", "high"] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _check_logprobs(self):
        if self.logprobs:
            raise InvalidRequestError("logprobs are not supported on Ollama's API (use "
                                      "/v1/chat/completions)", "logprobs")  # fmt: skip
        keep_alive_seconds(self.keep_alive)  # a bad duration is a 400 on any server
        return self

    @property
    def keep_alive_s(self) -> float | None:
        return keep_alive_seconds(self.keep_alive)

    def common(self) -> dict:
        """The fields every translated request shares."""
        body: dict = {"model": self.model, **(self.options.sampling() if self.options else {})}
        if self.format == "json":
            body["response_format"] = {"type": "json_object"}
        elif isinstance(self.format, dict):
            spec = {"name": "output", "schema": self.format}
            body["response_format"] = {"type": "json_schema", "json_schema": spec}
        return body

    def thinking(self) -> dict:
        if self.think is False:
            return {"reasoning_effort": "none"}
        if self.think is True:
            return {"chat_template_kwargs": {"enable_thinking": True}}
        if isinstance(self.think, str):
            return {"chat_template_kwargs": {"enable_thinking": True},
                    "thinking_token_budget": EFFORT_BUDGETS[self.think]}  # fmt: skip
        return {}


class OllamaChatRequest(OllamaBaseGenerate):
    messages: list[OllamaMessage] = Field(default_factory=list)
    tools: list[OllamaTool] | None = None
    # quill's extension (Ollama always lets the model choose): OpenAI's tool_choice.
    tool_choice: Literal["auto", "required", "none"] | dict | None = None

    def chat_request(self) -> dict:
        call_ids: list[str] = []
        messages = [m.chat_message(i, call_ids) for i, m in enumerate(self.messages)]
        body = {**self.common(), **self.thinking(), "messages": messages}
        if self.tools:
            body["tools"] = [t.model_dump(exclude_none=True) for t in self.tools]
            body["tool_choice"] = self.tool_choice
        return {k: v for k, v in body.items() if v is not None}


class OllamaGenerateRequest(OllamaBaseGenerate):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = False
    images: list[str] | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.images:
            raise InvalidRequestError("images are not supported", "images")
        if self.context:
            raise InvalidRequestError("context (a conversation's token ids) is not supported: "
                                      "send the conversation to /api/chat", "context")  # fmt: skip
        if self.template:
            raise InvalidRequestError("a per-request template is not supported", "template")
        return self

    @property
    def as_text(self) -> bool:
        """Whether the prompt goes to the model as it is (raw, or an infill's prefix)."""
        return bool(self.raw) or self.suffix is not None

    def completion_request(self) -> dict:
        """`raw` or infill: a completion of the prompt itself."""
        body = {**self.common(), "prompt": self.prompt or "", "suffix": self.suffix}
        return {k: v for k, v in body.items() if v is not None}

    def chat_request(self) -> dict:
        messages = [{"role": "system", "content": self.system}] if self.system else []
        messages.append({"role": "user", "content": self.prompt or ""})
        return {**self.common(), **self.thinking(), "messages": messages}


class OllamaEmbedRequest(Lenient):
    model: str = Field(min_length=1)
    input: str | list[str]
    truncate: bool | None = True
    dimensions: int | None = Field(None, ge=1)
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None

    @property
    def keep_alive_s(self) -> float | None:
        return keep_alive_seconds(self.keep_alive)

    @model_validator(mode="after")
    def _check(self):
        keep_alive_seconds(self.keep_alive)
        return self

    def inputs(self) -> list[str]:
        if isinstance(self.input, str):
            return [self.input]
        if not self.input:
            raise InvalidRequestError("input must not be empty", "input")
        return list(self.input)


class OllamaLegacyEmbeddingsRequest(Lenient):
    """/api/embeddings, the older one-text endpoint (`ollama.embeddings`)."""

    model: str = Field(min_length=1)
    prompt: str
    options: OllamaOptions | None = None
    keep_alive: float | str | None = None

    @property
    def keep_alive_s(self) -> float | None:
        return keep_alive_seconds(self.keep_alive)


class OllamaShowRequest(Lenient):
    model: str | None = None
    name: str | None = None  # the older clients' field
    verbose: bool | None = None

    @model_validator(mode="after")
    def _check(self):
        if not (self.model or self.name):
            raise InvalidRequestError("model is required", "model")
        return self
