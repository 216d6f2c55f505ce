"""Request schemas of the OpenAI-compatible API, and their translation to SamplingParams.

The field policy they follow (strict types, unsupported fields refused, unknown ones named in
the log, JSON inside fields bounded) is quill/server/fields.py's; the fields that constrain a
reply are typed in quill/server/constraints.py.

Responses are built as plain dicts in the endpoint modules: per streamed token, a pydantic model
would cost more than the token.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, PrivateAttr, ValidationInfo, model_validator

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.contract.sampling_params import SamplingParams
from quill.frontend.json_limits import DEFAULT_LIMITS, JsonLimits
from quill.frontend.tools import Function, ToolChoice, read_tools
from quill.server.constraints import (
    CONSTRAINT_FIELDS,
    ResponseFormat,
    StructuredOutputs,
    Tool,
    ToolChoiceField,
    constraint_of,
)
from quill.server.fields import INT64_MAX, INT64_MIN, Count, Int64, Lenient, limits_of

# torch.Generator.manual_seed takes any int in this range; a seed outside it would fail inside
# an engine step, so it is refused at the door.
_SEED_MIN, _SEED_MAX = INT64_MIN, 2**64 - 1


class StreamOptions(Lenient):
    include_usage: bool | None = False
    # vLLM's extension: usage (so far) in every chunk, not only in a last one.
    continuous_usage_stats: bool | None = False


class KVTransferParams(Lenient):
    """Disaggregation's request field (named as vLLM's): to a prefill instance,
    `do_remote_decode` (compute the prompt and its first token, and hold the KV for a decode
    instance); to a decode instance, `do_remote_prefill` and where the prompt's KV is (what
    the prefill instance's reply gave in its own `kv_transfer_params`)."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = Field(None, ge=1, le=65535)
    remote_request_id: str | None = None
    remote_block_ids: list[Count] | None = None
    num_tokens: Count | None = None
    first_token_id: Count | None = None

    @model_validator(mode="after")
    def _check(self):
        if self.do_remote_decode and self.do_remote_prefill:
            raise InvalidRequestError(
                "kv_transfer_params: do_remote_decode and do_remote_prefill exclude each other",
                param="kv_transfer_params",
            )
        if self.do_remote_prefill:
            missing = [k for k in _REMOTE_FIELDS if getattr(self, k) is None]
            if missing:
                raise InvalidRequestError(
                    f"kv_transfer_params with do_remote_prefill needs {', '.join(missing)}",
                    param="kv_transfer_params",
                )
        return self


_REMOTE_FIELDS = (
    "remote_host",
    "remote_port",
    "remote_request_id",
    "remote_block_ids",
    "num_tokens",
    "first_token_id",
)


class SamplingRequest(Lenient):
    """Fields common to /v1/completions and /v1/chat/completions."""

    model: str | None = None  # optional as in vLLM and llama.cpp: defaults to the served model
    # 0: the prompt computed and scored, nothing generated (with echo or prompt_logprobs).
    max_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    max_completion_tokens: int | None = Field(None, ge=0, le=INT64_MAX)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    # Any k at or past the vocabulary means no limit; -1 and 0 mean none either (vLLM).
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    seed: int | None = Field(None, ge=_SEED_MIN, le=_SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int64] | None = None
    ignore_eos: bool | None = False
    min_tokens: Count | None = 0
    n: int | None = Field(1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    # vLLM's flag for slow tokenizers; quill's fast tokenizers never add such spaces.
    spaces_between_special_tokens: bool | None = True
    # Keep only the last k prompt tokens (vLLM); -1 keeps what fits the model's context.
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    # Scheduling (vLLM's extensions): a lower priority is served first under
    # --scheduling-policy priority; requests share cached prefixes only with the same cache_salt.
    priority: Int64 | None = 0
    cache_salt: str | None = Field(None, min_length=1)
    # quill's: refuse at once (503) a request whose first token is predicted later than this.
    ttft_slo_ms: float | None = Field(None, gt=0)
    # Disaggregation (quill serve --role, quill router).
    kv_transfer_params: KVTransferParams | None = None
    # Structured output: one of these a request (quill/server/constraints.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _constraint: Constraint | None = PrivateAttr(None)
    _constraint_field: str | None = PrivateAttr(None)  # the field it came from
    _limits: JsonLimits = PrivateAttr(DEFAULT_LIMITS)
    # OpenAI's: token id (as a JSON key) -> bias in [-100, 100].
    logit_bias: dict[str, float] | None = None
    # vLLM's: each prompt token's logprob and the top n there (not streamed, as in vLLM).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    # Accepted and ignored, as they change nothing about what is generated.
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    length_penalty: float | None = None  # beam search only

    @model_validator(mode="after")
    def _check_common(self, info: ValidationInfo):
        self._limits = limits_of(info)
        if self.stream_options is not None and not self.stream:
            raise InvalidRequestError(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise InvalidRequestError(
                "prompt_logprobs are not available when stream is true", param="prompt_logprobs"
            )
        if self.max_tokens_asked == 0 and not self.scores_prompt:
            raise InvalidRequestError(
                "max_tokens 0 generates nothing: it asks for the prompt scored, with "
                + self._scoring_fields,
                param="max_tokens",
            )
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequestError(
                "truncate_prompt_tokens must be -1 or at least 1", param="truncate_prompt_tokens"
            )
        fields = {name: getattr(self, name) for name in CONSTRAINT_FIELDS if name != "tools"}
        found = constraint_of(fields, self._limits)
        if found is not None:
            self._constraint_field, self._constraint = found
        return self

    @property
    def constraint_field(self) -> str | None:
        """The field whose constraint the reply follows (named in the engine's refusals)."""
        return self._constraint_field

    _scoring_fields: ClassVar[str] = "prompt_logprobs"  # what max_tokens 0 needs beside it

    @property
    def scores_prompt(self) -> bool:
        """The reply holds the prompt's own logprobs."""
        return self.prompt_logprobs is not None

    @property
    def max_tokens_asked(self) -> int | None:
        """max_completion_tokens, else max_tokens (0 is an answer: the prompt alone)."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def num_choices(self) -> int:
        return self.n or 1

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def scheduling(self) -> dict:
        """The engine's add_request arguments besides the prompt and the sampling params."""
        return {
            "priority": self.priority or 0,
            "cache_salt": self.cache_salt,
            "ttft_slo": None if self.ttft_slo_ms is None else self.ttft_slo_ms / 1000,
        }

    def truncate(self, token_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the engine gets it: its last truncate_prompt_tokens tokens, if asked."""
        k = self.truncate_prompt_tokens
        if k is None:
            return token_ids
        k = max_model_len if k == -1 else k
        return token_ids[-k:] if len(token_ids) > k else token_ids

    def sampling_params(
        self,
        default_max_tokens: int | None,
        logprobs: int | None,
        index: int,
        prompt_logprobs: int | None = None,
    ) -> SamplingParams:
        """Params of choice `index`; seeded choices get seed + index so they differ.
        `prompt_logprobs`: the top n to score the prompt with (None: none)."""
        max_tokens = self.max_tokens_asked
        if max_tokens is None:
            max_tokens = default_max_tokens
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
            prompt_logprobs=prompt_logprobs,
            min_tokens=self.min_tokens or 0,
            include_stop_str_in_output=bool(self.include_stop_str_in_output),
            skip_special_tokens=self.skip_special_tokens is not False,
            structured=self._constraint,
            logit_bias=self._logit_bias(),
        )

    def _logit_bias(self) -> dict[int, float] | None:
        if not self.logit_bias:
            return None
        try:
            return {int(token_id): bias for token_id, bias in self.logit_bias.items()}
        except ValueError:
            raise InvalidRequestError(
                "logit_bias keys must be token ids (integers)", param="logit_bias"
            ) from None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[Int64] | list[list[Int64]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1, le=128)
    add_special_tokens: bool | None = True  # vLLM: whether to add the BOS token and the like
    # Code infill: the text after the cursor; the prompt is the text before it, and the reply
    # the middle (quill/frontend/infill.py lays them out in the model's FIM tokens).
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix is not None:
            if not all(isinstance(p, str) for p in self.prompts()):
                raise InvalidRequestError("suffix needs the prompt as text (the code before "
                                          "the cursor)", param="suffix")  # fmt: skip
            if self.echo:
                raise InvalidRequestError("echo is not available with suffix", param="echo")
        if isinstance(self.prompt, list) and (
            not self.prompt or any(isinstance(p, list) and not p for p in self.prompt)
        ):
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.best_of is not None and self.best_of != self.num_choices:
            raise InvalidRequestError("best_of is not supported (it must equal n)", param="best_of")
        return self

    _scoring_fields: ClassVar[str] = "echo or prompt_logprobs"

    @property
    def scores_prompt(self) -> bool:
        return bool(self.echo) or self.prompt_logprobs is not None

    @property
    def num_prompt_logprobs(self) -> int | None:
        """The top n the engine scores the prompt with: vLLM's prompt_logprobs, and the
        logprobs of echoed prompt tokens (echo with logprobs)."""
        wanted = [self.prompt_logprobs]
        if self.echo and self.logprobs is not None:
            wanted.append(self.logprobs)
        wanted = [n for n in wanted if n is not None]
        return max(wanted) if wanted else None

    def prompts(self) -> list[str | list[int]]:
        """The prompt field as a list of prompts (one text or one list of token ids each)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(t, int) for t in p):
            return [p]  # a single prompt given as token ids
        return list(p)


class TextPart(Lenient):
    type: Literal["text"]
    text: str


class FunctionCall(Lenient):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(Lenient):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Lenient):
    # "developer" is OpenAI's newer name for "system".
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # the call a tool message answers
    # An assistant turn's thinking, given back (vLLM's field; `reasoning` its newer name):
    # templates such as Qwen3's show it for the turns of the current tool loop.
    reasoning_content: str | None = None
    reasoning: str | None = None

    def as_template_dict(self) -> dict:
        if isinstance(self.content, list):
            text = "\n".join(part.text for part in self.content)
        else:
            text = self.content or ""
        out = {"role": "system" if self.role == "developer" else self.role, "content": text}
        if self.tool_calls:
            out["tool_calls"] = [call.model_dump() for call in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        thinking = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if thinking is not None and self.role == "assistant":
            out["reasoning_content"] = thinking
        return out


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool | None = True
    # Function calling (quill/server/tools.py); tool_choice defaults to "auto" with tools.
    tools: list[Tool] | None = None
    tool_choice: ToolChoiceField | None = None
    parallel_tool_calls: bool | None = None
    # Reasoning models (vLLM's fields): arguments for the chat template (Qwen3's
    # {"enable_thinking": false}), whether the reply's thinking is returned, and a cap on
    # its tokens, after which the end-of-thinking marker is forced. OpenAI's
    # reasoning_effort "none" turns thinking off where the template has the switch.
    chat_template_kwargs: dict | None = None
    include_reasoning: bool | None = True
    thinking_budget: Count | None = Field(None, alias="thinking_token_budget")
    reasoning_effort: str | None = None  # only "none" changes anything here
    _functions: list[Function] = PrivateAttr(default_factory=list)
    _tool_choice: ToolChoice | None = PrivateAttr(None)
    # OpenAI's "text" is the only output modality of a language model server.
    modalities: list[str] | None = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError(
                "top_logprobs requires logprobs to be true", param="top_logprobs"
            )
        self._read_tools()
        if self.chat_template_kwargs is not None:
            self._limits.check_value(self.chat_template_kwargs, "chat_template_kwargs",
                                     "chat_template_kwargs")  # fmt: skip
        if self.modalities and set(self.modalities) != {"text"}:
            raise InvalidRequestError("only the text modality is supported", param="modalities")
        for m in self.messages:
            if m.content is None and m.role != "assistant":
                raise InvalidRequestError(f"a {m.role} message needs content", param="messages")
            if m.role == "tool" and m.tool_call_id is None:
                raise InvalidRequestError("a tool message needs tool_call_id", param="messages")
            if m.tool_calls and m.role != "assistant":
                raise InvalidRequestError("only assistant messages have tool_calls", "messages")
        return self

    def _read_tools(self) -> None:
        limits = self._limits
        tools = None if self.tools is None else [t.model_dump(by_alias=True) for t in self.tools]
        for i, tool in enumerate(tools or []):
            parameters = tool["function"].get("parameters")
            if parameters is not None:
                limits.check_value(parameters, "tools", f"tools.{i}.function.parameters")
        choice = self.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = choice.model_dump()
        self._functions, self._tool_choice = read_tools(tools, choice, self.parallel_tool_calls)
        if self._tool_choice is None:
            return
        if self._constraint is not None:
            raise InvalidRequestError(
                "a reply can follow structured outputs or tools, not both "
                '(tool_choice "none" leaves the tools unused)',
                param="tools",
            )

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def tool_choice_made(self) -> ToolChoice | None:
        """How the reply must use the tools (None: it is plain text)."""
        return self._tool_choice

    @property
    def functions(self) -> list[Function]:
        return self._functions

    @property
    def limits(self) -> JsonLimits:
        return self._limits

    @property
    def constraint(self) -> Constraint | None:
        """The structured output asked for (tools aside: the chat format makes theirs)."""
        return self._constraint

    def template_kwargs(self) -> dict:
        """The chat template's arguments this request asks for."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort == "none":
            kwargs.setdefault("enable_thinking", False)
        return kwargs

    def template_messages(self) -> list[dict]:
        return [m.as_template_dict() for m in self.messages]


class TokenizeRequest(Lenient):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    return_token_strs: bool | None = False

    _limits: JsonLimits = PrivateAttr(DEFAULT_LIMITS)

    @model_validator(mode="after")
    def _one_input(self, info: ValidationInfo):
        self._limits = limits_of(info)
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequestError("give exactly one of prompt and messages", param="prompt")
        return self

    @property
    def limits(self) -> JsonLimits:
        return self._limits

    def template_messages(self) -> list[dict]:
        return [m.as_template_dict() for m in self.messages or []]


class DetokenizeRequest(Lenient):
    model: str | None = None
    tokens: list[Int64]
