"""The offline engine: front end and engine in one process, text in, outputs out.

`LLMEngine` puts the front end (quill.frontend: tokenizing and checks, detokenizing and stop
strings) around an `EngineWorker` (the core, its model and the step observers) in the
caller's process; `quill serve` puts the same two halves in two processes. `add_request` and
`abort_request` are safe to call from other threads: they validate at once, so bad input fails
in the caller. `step` runs in one thread only.
"""

from __future__ import annotations

import logging

from quill.config import EngineConfig
from quill.contract.errors import InvalidRequestError
from quill.contract.messages import StepStats
from quill.contract.outputs import RequestMetrics, RequestOutput
from quill.contract.plan import StepPlan
from quill.contract.sampling_params import SamplingParams
from quill.engine.scheduler import Scheduler
from quill.engine.worker import EngineWorker
from quill.frontend.inputs import InputProcessor
from quill.frontend.outputs import OutputProcessor

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "StepStats"]


class LLMEngine:
    """Continuous batching over a paged KV cache, on a real model; see the scheduler."""

    def __init__(self, config: EngineConfig, clock=None) -> None:
        self.config = config
        self.worker = EngineWorker(config, clock)
        built = self.worker.built
        self.runner = built.runner
        self.tokenizer = built.tokenizer
        self.model_config = built.model_config
        self.model_path = built.model_path
        self.device, self.dtype = built.device, built.dtype
        self.kv_format = built.kv_format
        self.max_model_len = built.max_model_len
        self.accountant = self.worker.accountant
        self.core = self.worker.core
        self.clock = self.worker.clock
        self.inputs = InputProcessor(self.tokenizer, built.model_config.vocab_size,
                                     built.max_model_len)  # fmt: skip
        self.outputs = OutputProcessor(self.tokenizer, self._on_stop)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def last_step(self) -> StepStats | None:
        return self.core.last_step

    @property
    def last_plan(self) -> StepPlan | None:
        return self.core.last_plan

    # -- requests (any thread) -------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        ttft_slo: float | None = None,
        kv_lease_s: float | None = None,
        remote_kv=None,
    ) -> str:
        """Validate and queue a request for the next step; raises InvalidRequestError, or
        OverloadedError when its predicted time to first token exceeds its SLO (`ttft_slo`
        seconds, or the engine's `max_ttft_slo`)."""
        req = self.inputs.make_request(
            prompt,
            params,
            request_id,
            self.clock.now() if arrival_time is None else arrival_time,
            priority,
            cache_salt,
            ttft_slo,
            kv_lease_s,
            remote_kv,
        )
        text = prompt if isinstance(prompt, str) else None
        if req.request_id in self.outputs:
            raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
        self.outputs.add(req.request_id, text, req.prompt_token_ids, req.sampling_params)
        try:
            self.worker.add(req, text)
        except BaseException:
            self.outputs.discard(req.request_id)
            raise
        return req.request_id

    def abort_request(self, request_id: str) -> None:
        self.worker.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.worker.has_unfinished_requests()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any (they also stop when this process
        exits)."""
        self.worker.close()

    @property
    def num_unscheduled(self) -> int:
        return self.worker.num_unscheduled

    # -- the step (engine thread) ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One pass of the model; returns an output for every request that advanced or ended."""
        return self.step_with_stats()[0]

    def step_with_stats(self) -> tuple[list[RequestOutput], StepStats | None]:
        """`step`, and what the step did when it ran a model pass (None when it ran none; its
        plan is then `last_plan`)."""
        out = self.worker.step()
        stats = out.stats if out.stats.num_batched_tokens else None
        return self.outputs.process(out.updates), stats

    @property
    def token_budget(self) -> int:
        return self.scheduler.token_budget

    def set_token_budget(self, num_tokens: int) -> None:
        """Tokens per step from the next step on."""
        self.core.set_token_budget(num_tokens)

    def _on_stop(self, request_id: str, stop: str, metrics: RequestMetrics) -> RequestMetrics:
        # In one process the request ends now, between steps, as if the engine had found it.
        final = self.worker.finish_now(request_id, "stop", stop)
        return final if final is not None else metrics
