"""The engine's front end: text in, one scheduled model pass per step, incremental outputs out.

It wraps the torch-free engine core with what only a real model needs: the tokenizer, the
incremental detokenizer (and with it stop strings) and the request outputs a caller reads.
`add_request` and `abort_request` are safe to call from other threads (the HTTP server's event
loop): they validate at once, so bad input fails in the caller. `step` runs in one thread only.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass

from quill.config import EngineConfig
from quill.engine.core import CoreOutput, EngineCore, StepStats
from quill.engine.detokenizer import IncrementalDetokenizer
from quill.engine.kv_cache import KVCacheManager
from quill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler
from quill.errors import InvalidRequestError
from quill.sampling_params import SamplingParams

log = logging.getLogger(__name__)

__all__ = ["LLMEngine", "StepStats"]


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    num_sent_tokens: int = 0


class LLMEngine:
    """Continuous batching over a paged KV cache, on a real model; see the scheduler."""

    def __init__(self, config: EngineConfig, clock=None) -> None:
        from quill.model.factory import build_model_executor  # torch lives behind this

        self.config = config
        built = build_model_executor(config)
        self.runner = built.runner
        self.tokenizer = built.tokenizer
        self.model_config = built.model_config
        self.model_path = built.model_path
        self.device, self.dtype = built.device, built.dtype
        self.kv_cache_dtype = built.kv_cache_dtype
        self.max_model_len = built.max_model_len
        kv = KVCacheManager(built.num_blocks, config.block_size, config.enable_prefix_caching)
        scheduler = Scheduler(
            kv,
            built.token_budget,
            config.max_num_seqs,
            self.max_model_len,
            config.scheduling_policy,
            config.priority_aging,
        )
        self.accountant = _make_accountant(config, built)
        listeners = [self.accountant]
        if config.record_steps:
            from quill.engine.record import StepRecorder

            listeners.append(StepRecorder(config.record_steps))
        admission = _make_admission(config, self.accountant, built.token_budget)
        self.core = EngineCore(scheduler, self.runner, clock, listeners, admission)
        log.info(
            "prefix caching: %s; scheduling policy: %s%s",
            "on" if config.enable_prefix_caching else "off",
            config.scheduling_policy,
            f"; TTFT SLO {config.max_ttft_slo * 1000:g} ms" if config.max_ttft_slo else "",
        )
        self.clock = self.core.clock
        self._tracked: dict[str, _Tracked] = {}
        self._end_ids = frozenset(self.tokenizer.eos_token_ids)

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    @property
    def last_step(self) -> StepStats | None:
        return self.core.last_step

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
    ) -> str:
        """Validate and queue a request for the next step; raises InvalidRequestError, or
        OverloadedError when its predicted time to first token exceeds its SLO (`ttft_slo`
        seconds, or the engine's `max_ttft_slo`)."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an integer, got {priority!r}", "priority")
        if ttft_slo is not None and not (ttft_slo > 0 and math.isfinite(ttft_slo)):
            raise InvalidRequestError(
                f"ttft_slo must be positive seconds, got {ttft_slo}", "ttft_slo"
            )
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            text = None
            token_ids = list(prompt)
            self.check_token_ids(token_ids)
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            max_tokens=self.core.resolve_max_tokens(len(token_ids), params),
            eos_token_ids=self._end_ids,
            prompt=text,
            priority=priority,
            cache_salt=cache_salt,
            ttft_slo=ttft_slo,
        )
        self.core.add_request(request)
        return request_id

    def check_token_ids(self, token_ids: list[int]) -> None:
        """Raise InvalidRequestError unless every id is in the vocabulary."""
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
        if bad:
            raise InvalidRequestError(
                f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param="prompt"
            )

    def abort_request(self, request_id: str) -> None:
        self.core.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    @property
    def num_unscheduled(self) -> int:
        return self.core.num_unscheduled

    # -- the step (engine thread) ------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One pass of the model; returns an output for every request that advanced or ended."""
        out: CoreOutput = self.core.step()
        finished = list(out.finished)
        for request in out.advanced:
            tracked = self._track(request)
            token = request.output_token_ids[-1]
            if tracked.logprobs is not None:
                chosen, top = out.logprobs[request.request_id]
                entry = dict(top)
                entry[token] = chosen
                tracked.logprobs.append(entry)
            if request.is_finished and not _text_includes_last_token(request):
                continue
            stop = tracked.detokenizer.add_token(token)
            if stop is not None and not request.is_finished:
                self.core.finish_request(request.request_id, "stop", stop)
                finished.append(request)
        done = {r.request_id for r in finished}
        outputs = [self._finish(r) for r in finished]
        outputs += [
            self._output(self._tracked[r.request_id])
            for r in out.advanced
            if r.request_id not in done
        ]
        return outputs

    def _track(self, request: Request) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            params = request.sampling_params
            tracked = _Tracked(
                request,
                IncrementalDetokenizer(
                    self.tokenizer,
                    request.prompt_token_ids,
                    params.stop,
                    params.include_stop_str_in_output,
                    params.skip_special_tokens,
                ),
                [] if params.logprobs is not None else None,
            )
            self._tracked[request.request_id] = tracked
        return tracked

    def _finish(self, request: Request) -> RequestOutput:
        tracked = self._tracked.pop(request.request_id, None)
        if tracked is None:  # ended before it produced a token
            tracked = _Tracked(request, IncrementalDetokenizer(self.tokenizer, [], []), None)
        output = self._output(tracked, request.error)
        self.accountant.take(request.request_id)
        return output

    def _output(self, tracked: _Tracked, error: str | None = None) -> RequestOutput:
        request = tracked.request
        finished = request.is_finished
        new_tokens = request.output_token_ids[tracked.num_sent_tokens :]
        delta_logprobs = None
        if tracked.logprobs is not None:
            delta_logprobs = tracked.logprobs[tracked.num_sent_tokens :]
        tracked.num_sent_tokens = request.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason if finished else None,
            stop_reason=request.stop_reason,
            logprobs=tracked.logprobs,
            delta_text=tracked.detokenizer.take_delta(finished),
            delta_token_ids=new_tokens,
            delta_logprobs=delta_logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics.of(request, self.accountant.peek(request.request_id)),
            error=error,
        )


def _text_includes_last_token(request: Request) -> bool:
    """A reply ended by an end-of-sequence or stop token id keeps that token out of its text
    (it stays in token_ids), unless include_stop_str_in_output; as in vLLM."""
    ended_by_token = request.finish_reason == "stop" and not isinstance(request.stop_reason, str)
    return not ended_by_token or request.sampling_params.include_stop_str_in_output


def _make_admission(config: EngineConfig, accountant, token_budget: int):
    """Predicts every request's TTFT (and refuses those past an SLO): priced by the cost model,
    corrected by the measured steps, when this machine has a hardware spec; else by a line fit
    of the measured steps against their token counts."""
    from quill.engine.admission import AdmissionControl, StepTimer

    cost_model = accountant.cost_model
    if cost_model is not None:
        timer = StepTimer.from_cost_model(cost_model)
    else:
        timer = StepTimer.by_tokens()
    return AdmissionControl(
        config.max_ttft_slo,
        timer,
        token_budget,
        config.scheduling_policy,
        config.priority_aging,
    )


def _make_accountant(config: EngineConfig, built):
    """Prices every step on the configured hardware, or this machine's saved calibration."""
    from quill.cost.hardware import HardwareSpec
    from quill.cost.live import CostAccountant, find_calibration
    from quill.cost.model import ModelSpec
    from quill.cost.step import CostModel

    model = ModelSpec.from_hf_config(built.hf_config, bytes_per_param=built.dtype.itemsize)
    model.kv_bytes_per_element = built.kv_cache_dtype.itemsize  # the cache's, not the weights'
    dtype = str(built.dtype).removeprefix("torch.")
    if config.hardware is not None:
        hardware = HardwareSpec.resolve(config.hardware)
    else:
        hardware = find_calibration(dtype)
    if hardware is None:
        log.info(
            "cost: no hardware spec (--hardware, or run `quill cost calibrate` once); requests "
            "get FLOPs and bytes, steps get no roofline efficiency"
        )
        return CostAccountant(model, None, config.price_per_hour)
    log.info("cost: pricing steps on %s", hardware.name)
    return CostAccountant(model, CostModel(model, hardware), config.price_per_hour)
