"""Sampling parameters of one request, validated when made."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.contract.pooling import PoolingParams

# Below this temperature sampling is greedy, as in vLLM: dividing logits by 1e-5 already gives
# the top token all the mass unless the runner-up is within ~1e-3, and smaller values would
# only overflow float32 or amplify rounding noise. `SamplingParams.greedy` is the one test.
GREEDY_TEMPERATURE = 1e-5

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# The smallest positive value a strictly positive field takes. A subnormal double is zero or
# not depending on the process's float mode (torch flushes them to zero on CPU, and Python's
# own comparisons then see 0), so it is refused rather than accepted by chance.
_MIN_POSITIVE = sys.float_info.min
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, shaped like vLLM's SamplingParams.

    A temperature below `GREEDY_TEMPERATURE` (0 included) means greedy. `top_k` may exceed the
    vocabulary (no limit then). `max_tokens=None` lets the reply run to the model's context;
    `max_tokens=0` computes the prompt and generates nothing (scoring it with `prompt_logprobs`).
    """

    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no limit
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (0: only the chosen one)
    # The same for the prompt's tokens (vLLM's name): each one's logprob given the tokens
    # before it, and the top n there; the first token has none.
    prompt_logprobs: int | None = None
    min_tokens: int = 0
    include_stop_str_in_output: bool = False  # keep a matched stop string at the text's end
    skip_special_tokens: bool = True  # leave special tokens out of the text
    # What the reply must match (a JSON schema, a regex, ...), enforced token by token.
    structured: Constraint | None = None
    # OpenAI's: added to these tokens' logits before sampling, each in [-100, 100] (-100 bars
    # a token in practice, +100 all but forces it).
    logit_bias: dict[int, float] | None = None
    # A cap on a reasoning model's thinking: once the reply has `thinking_budget` tokens and
    # has not yet written `thinking_end_ids` (the end-of-thinking marker), the marker is
    # forced. With `thinking_start_ids` the cap applies only to a reply that begins with them
    # (a model that opens its own block, and may not).
    thinking_budget: int | None = None
    thinking_end_ids: list[int] = field(default_factory=list)
    thinking_start_ids: list[int] = field(default_factory=list)
    # An embedding instead of tokens (quill/contract/pooling.py): with max_tokens 0.
    pooling: PoolingParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(param: str, message: str) -> InvalidRequestError:
            return InvalidRequestError(message, param=param)

        # NaN passes checks written as `x < lo` (its comparisons are all false); inf is no
        # usable value for any of these.
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not math.isfinite(value):
                raise bad(name, f"{name} must be a finite number, got {value}")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise bad("max_tokens", f"max_tokens must be non-negative, got {self.max_tokens}")
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not _MIN_POSITIVE <= self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1] and not subnormal, got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        # The sampler puts these in an int64 tensor (min_tokens suppresses them).
        for token_id in self.stop_token_ids:
            if not _INT64_MIN <= token_id <= _INT64_MAX:
                raise bad("stop_token_ids", f"stop token id {token_id} is out of range")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        # Any positive finite value works: the sampler bounds it and clamps what it produces.
        if not self.repetition_penalty >= _MIN_POSITIVE:
            raise bad(
                "repetition_penalty",
                "repetition_penalty must be positive and not subnormal, "
                f"got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(name, f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= 20:
            raise bad(
                "prompt_logprobs", f"prompt_logprobs must be in [0, 20], got {self.prompt_logprobs}"
            )
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.thinking_budget is not None and (
            self.thinking_budget < 0 or not self.thinking_end_ids
        ):
            raise bad("thinking_budget", "thinking_budget must be non-negative, for a model "
                      "whose end-of-thinking marker is known")  # fmt: skip
        for token_id, bias in (self.logit_bias or {}).items():
            if not (math.isfinite(bias) and -100 <= bias <= 100):
                raise bad("logit_bias", f"logit_bias of token {token_id} must be in [-100, 100]")
        if self.pooling is not None and (self.max_tokens != 0 or self.prompt_logprobs is not None):
            raise bad("pooling", "a pooling request computes its prompt only: max_tokens 0, no "
                      "prompt_logprobs")  # fmt: skip

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def is_plain(self) -> bool:
        """Only the choice of tokens: no penalty (a step needs no token history), constraint,
        thinking budget or pooling. The engine's plan is made leaner for these."""
        return (
            self.structured is None
            and self.thinking_budget is None
            and self.pooling is None
            and self.repetition_penalty == 1.0  # uses_penalties, inline: once a sequence a step
            and self.presence_penalty == 0.0
            and self.frequency_penalty == 0.0
        )

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
