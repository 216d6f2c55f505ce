"""Request schemas of the OpenAI-compatible API, and their translation to SamplingParams.

Requests are parsed strictly (no "16" for 16, no 1 for true) and reject unknown fields, as
OpenAI's API does. A few vLLM extensions that its users send (top_k, min_p,
repetition_penalty, ignore_eos, ...) are accepted too. Responses are built as plain dicts in
the endpoint modules: per streamed token, a pydantic model would cost more than the token.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from quill.errors import InvalidRequestError
from quill.sampling_params import SamplingParams

# torch.Generator.manual_seed takes any int in this range; a seed outside it would fail inside
# an engine step, so it is refused at the door.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool | None = False


class _SamplingRequest(_Strict):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None  # optional as in vLLM and llama.cpp: defaults to the served model
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(0, ge=0)
    n: int | None = Field(1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None
    # Accepted and ignored, as they change nothing about what is generated.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if self.logit_bias:
            raise InvalidRequestError("logit_bias is not supported", param="logit_bias")
        return self

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, default_max_tokens: int | None, logprobs: int | None, index: int
    ) -> SamplingParams:
        """Params of choice `index`; seeded choices get seed + index so they differ."""
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        seed = None if self.seed is None else self.seed + index
        if seed is not None and seed > _SEED_MAX:
            raise InvalidRequestError("seed + n - 1 is out of range", param="seed")
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=bool(self.ignore_eos),
            logprobs=logprobs,
            min_tokens=self.min_tokens or 0,
        )


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _check_completion(self):
        if isinstance(self.prompt, list) and (
            not self.prompt or any(isinstance(p, list) and not p for p in self.prompt)
        ):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.suffix:
            raise InvalidRequestError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise InvalidRequestError("best_of is not supported (it must equal n)", param="best_of")
        if self.echo and self.logprobs is not None:
            # Echoed prompt tokens need prompt logprobs, which the engine does not compute.
            raise InvalidRequestError("echo together with logprobs is not supported", param="echo")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (one text or one list of token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [p]  # a single prompt given as token ids
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool | None = True
    response_format: dict | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        if self.tools:
            raise InvalidRequestError("tools are not supported", param="tools")
        if self.response_format and self.response_format.get("type") != "text":
            raise InvalidRequestError(
                "only response_format {'type': 'text'} is supported", param="response_format"
            )
        for m in self.messages:
            if m.content is None and m.role != "assistant":
                raise InvalidRequestError(f"a {m.role} message needs content", param="messages")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict]:
        return [m.as_template_dict() for m in self.messages]


class TokenizeRequest(_Strict):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        return self


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]
