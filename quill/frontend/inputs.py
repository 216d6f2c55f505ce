"""A prompt and its options as an `EngineRequest`: tokenized and checked, once, here.

What can be checked without the engine's state is checked before the request leaves the front
end (token ids in the vocabulary, the reply's limit against the context, the scheduling
options' types); the engine checks only what needs its state (room in the KV pool, the SLO).
"""

from __future__ import annotations

import math
import uuid

from quill.contract.errors import InvalidRequestError
from quill.contract.messages import EngineRequest
from quill.contract.plan import RemoteKV
from quill.contract.sampling_params import SamplingParams
from quill.frontend.tokenizer import Tokenizer


class InputProcessor:
    """Turns prompts into engine requests for one model (its vocabulary and context)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len

    def make_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float = 0.0,
        priority: int = 0,
        cache_salt: str | None = None,
        ttft_slo: float | None = None,
        kv_lease_s: float | None = None,
        remote_kv: RemoteKV | None = None,
    ) -> EngineRequest:
        """Raises InvalidRequestError for anything that could never be served as asked.
        `kv_lease_s` (a prefill instance's request) and `remote_kv` (a decode instance's)
        are disaggregation's (quill/disagg)."""
        params = params or SamplingParams()
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if ttft_slo is not None and not (ttft_slo > 0 and math.isfinite(ttft_slo)):
            raise InvalidRequestError(
                f"ttft_slo must be positive seconds, got {ttft_slo}", "ttft_slo"
            )
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            token_ids = list(prompt)
            self.check_token_ids(token_ids)
        if params.logit_bias:
            self.check_token_ids(list(params.logit_bias), "logit_bias")
        if kv_lease_s is not None and not (kv_lease_s > 0 and math.isfinite(kv_lease_s)):
            raise InvalidRequestError(f"kv_lease_s must be positive, got {kv_lease_s}")
        if remote_kv is not None:
            if remote_kv.num_tokens != len(token_ids):
                raise InvalidRequestError(
                    f"the remote KV holds {remote_kv.num_tokens} tokens, the prompt has "
                    f"{len(token_ids)}",
                    "prompt",
                )
            self.check_token_ids([remote_kv.first_token_id])
        return EngineRequest(
            request_id=request_id or uuid.uuid4().hex,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=arrival_time,
            max_tokens=self.resolve_max_tokens(len(token_ids), params),
            priority=priority,
            cache_salt=cache_salt,
            ttft_slo=ttft_slo,
            kv_lease_s=kv_lease_s,
            remote_kv=remote_kv,
        )

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        """Raise InvalidRequestError unless every id is in the vocabulary."""
        vocab = self.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param=param
            )

    def resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        """The reply's token limit: as asked, or what is left of the context; errors if neither."""
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        # A prompt that fills the context may still be computed (scored): it samples nothing.
        if room < 0 or (room == 0 and params.max_tokens != 0):
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens but the model's context is "
                f"{self.max_model_len} tokens",
                param="prompt",
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + params.max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} in the completion).",
                param="max_tokens",
            )
        return params.max_tokens
