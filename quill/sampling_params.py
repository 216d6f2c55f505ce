"""Sampling parameters of one request, validated when made."""

from __future__ import annotations

from dataclasses import dataclass, field

from quill.errors import InvalidRequestError


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, shaped like vLLM's SamplingParams.

    temperature 0 means greedy. `max_tokens=None` lets the reply run to the model's context.
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
    min_tokens: int = 0

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

        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise bad("temperature", f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise bad("top_k", f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            raise bad(
                "repetition_penalty",
                f"repetition_penalty must be positive, got {self.repetition_penalty}",
            )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2 <= value <= 2:
                raise bad(name, f"{name} must be in [-2, 2], got {value}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", f"logprobs must be in [0, 20], got {self.logprobs}")
        if self.min_tokens < 0:
            raise bad("min_tokens", f"min_tokens must be non-negative, got {self.min_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )
