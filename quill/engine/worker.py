"""The engine beneath the front end: the core, its model executor and the step observers.

It speaks only the messages of quill.contract.messages: `add` takes an `EngineRequest`,
`step` returns `EngineOutputs` (per request the tokens it gained, and one `StepStats`). The
same object serves the offline `LLMEngine` in the caller's process and the engine process of
`quill serve` (quill/engine/process.py), so both run one definition of a step.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path

from quill.config import EngineConfig, resolve_task
from quill.contract.errors import ModelLoadError
from quill.contract.messages import (
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    KVTransferStats,
    RequestUpdate,
    StepPrice,
    StepStats,
    StructuredStats,
)
from quill.contract.outputs import RequestMetrics
from quill.contract.plan import RemoteKV
from quill.contract.pooling import finish_embedding
from quill.engine.core import CoreOutput, EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineWorker:
    """Continuous batching over a paged KV cache, on a real model; see the scheduler."""

    def __init__(self, config: EngineConfig, clock=None) -> None:
        self.config = config
        if config.tensor_parallel_size > 1:  # the ranks, rank 0 here (torch lives behind this)
            from quill.distributed.executor import start_tensor_parallel

            built = start_tensor_parallel(config)
        else:
            from quill.model.factory import build_model_executor

            built = build_model_executor(config)
        try:
            self._assemble(config, built, clock)
        except BaseException:  # the executor started ranks and threads: none may outlive this
            close = getattr(built.runner, "close", None)
            if close is not None:
                close()
            raise

    def _assemble(self, config: EngineConfig, built, clock) -> None:
        """The engine core and its observers around a built executor."""
        self.built = built
        self.runner = built.runner
        encoder = not built.model_config.causal
        if encoder and (config.cost_accounting or config.predict_ttft):
            # The cost model prices causal decoders' steps; an encoder's are not priced yet.
            config = replace(config, cost_accounting=False, predict_ttft=False)
            self.config = config
        kv = KVCacheManager(
            built.num_blocks,
            config.block_size,
            config.enable_prefix_caching and not encoder,  # an encoder's blocks hold nothing
            built.model_config.kv_groups.group_windows,
        )
        # The observers, each left out when off so that a step pays nothing for it.
        self.accountant = _make_accountant(config, built) if config.cost_accounting else None
        listeners = [self.accountant] if self.accountant is not None else []
        speculative = config.speculative
        switch = None
        if speculative is not None and speculative.by_cost:
            switch = _make_spec_switch(speculative, self.accountant)
            listeners.append(switch)
        if speculative is not None:
            log.info(
                "speculative decoding: %s, up to %d drafts (n-grams of %d..%d), %s",
                speculative.method,
                speculative.num_speculative_tokens,
                speculative.prompt_lookup_min,
                speculative.prompt_lookup_max,
                "in steps where the cost model says it pays" if switch else "every step",
            )
        scheduler = Scheduler(
            kv,
            built.token_budget,
            config.max_num_seqs,
            built.max_model_len,
            config.scheduling_policy,
            config.priority_aging,
            speculative,
            switch,
        )
        scheduler.whole_prompts = encoder
        if config.record_steps:
            from quill.engine.record import StepRecorder

            listeners.append(StepRecorder(config.record_steps))
        admission = None
        if config.predict_ttft:
            admission = _make_admission(config, self.accountant, built.token_budget)
        self.core = EngineCore(
            scheduler,
            self.runner,
            clock,
            listeners,
            admission,
            recompute_failed_fetches=config.kv_transfer_failure == "recompute",
            structured=None if encoder else _reply_matchers(built),  # an encoder writes no text
        )
        log.info(
            "prefix caching: %s; scheduling policy: %s; TTFT prediction: %s; cost accounting: %s%s",
            "on" if config.enable_prefix_caching and not encoder else "off",
            config.scheduling_policy,
            "on" if config.predict_ttft else "off",
            "on" if config.cost_accounting else "off",
            f"; TTFT SLO {config.max_ttft_slo * 1000:g} ms" if config.max_ttft_slo else "",
        )
        self.clock = self.core.clock
        self.kv_events = None
        events = config.kv_events
        if events is not None and kv.enable_prefix_caching:
            from quill.engine.kv_event_publisher import KVEventPublisher
            from quill.engine.kv_events import KVEventLog

            kv.pool.events = KVEventLog(config.block_size)
            self.kv_events = KVEventPublisher(events, config.data_parallel_rank)
        self.kv_server = None
        if config.tensor_parallel_size == 1 and not encoder:  # disaggregation: single-rank decoders
            from quill.disagg.fetch import KVFetcher

            name = built.model_path.name
            self.runner.kv_fetcher = KVFetcher(self.runner, name, config.kv_transfer_timeout)
            if config.kv_transfer_port is not None:
                from quill.disagg.serve import KVServer

                if kv.num_groups > 1:
                    raise ModelLoadError(
                        "disaggregated prefill moves one block table a request; this model's "
                        f"sliding-window layers beside global ones keep {kv.num_groups}"
                    )

                self.kv_server = KVServer(
                    self.core,
                    self.runner,
                    config.kv_transfer_host,
                    config.kv_transfer_port,
                    name,
                    config.kv_transfer_timeout,
                )
        self._end_ids = frozenset(built.tokenizer.eos_token_ids)
        self._num_reported: dict[str, int] = {}  # output tokens already sent, per request
        self.info = EngineInfo(
            model_path=str(built.model_path),
            tokenizer_source=str(built.tokenizer_source),
            eos_token_ids=list(built.tokenizer.eos_token_ids),
            vocab_size=built.model_config.vocab_size,
            max_model_len=built.max_model_len,
            num_kv_tokens=built.num_blocks * config.block_size,
            pid=os.getpid(),
            task=resolve_task(config.task, encoder, built.model_config.num_labels > 0),
            cross_encoder=encoder and built.model_config.num_labels > 0,
            encoder=encoder,
        )
        accountant = self.accountant
        if accountant is not None and accountant.cost_model is not None:
            self.info.hardware_name = accountant.cost_model.hardware.name
        if accountant is not None and accountant.has_price:
            self.info.price_per_hour = accountant.price_per_second * 3600

    @property
    def scheduler(self) -> Scheduler:
        return self.core.scheduler

    # -- requests (any thread) -------------------------------------------------------------
    def prepare(self, req: EngineRequest):
        """Start what a request needs before it is added: a constrained request's matcher, on
        a grammar thread. A future of it (`add`'s `prepared`), or None when there is nothing
        to prepare; InvalidRequestError when this engine cannot enforce constraints."""
        constraint = req.sampling_params.structured
        if constraint is None:
            return None
        self.core.check_structured()
        return self.core.structured.prepare(constraint)

    def add(self, req: EngineRequest, prompt: str | None = None, prepared=None) -> None:
        """Queue a request for the next step; raises InvalidRequestError when it can never be
        served here, OverloadedError when it would start past its TTFT SLO. A constrained
        request's matcher is prepared here (waited for) unless `prepared` is given."""
        request = Request(
            request_id=req.request_id,
            prompt_token_ids=req.prompt_token_ids,
            sampling_params=req.sampling_params,
            arrival_time=req.arrival_time,
            max_tokens=req.max_tokens,
            eos_token_ids=self._end_ids,
            prompt=prompt,
            priority=req.priority,
            cache_salt=req.cache_salt,
            ttft_slo=req.ttft_slo,
            kv_lease_s=req.kv_lease_s,
        )
        remote = req.remote_kv
        if remote is not None:  # the prompt's KV comes from a prefill instance, with its token
            request.remote_kv = remote
            request.kv_transferred = True
            request.output_token_ids.append(remote.first_token_id)
            request.num_computed_tokens = remote.num_tokens
        constraint = req.sampling_params.structured
        if constraint is not None and prepared is None:
            self.core.check_structured()
            prepared = self.core.structured.prepare_now(constraint)
            for warning in prepared.warnings:
                log.warning("%s: structured output: %s", req.request_id, warning)
        self.core.add_request(request, prepared)

    def abort(self, request_id: str, reason: str = "abort", stop_reason=None) -> None:
        self.core.abort_request(request_id, reason, stop_reason)

    def finish_now(self, request_id: str, reason: str, stop_reason=None) -> RequestMetrics | None:
        """End a request at once, from the engine's thread (between steps): its final timings,
        or None when it had already ended."""
        request = self.core.finish_request(request_id, reason, stop_reason)
        if request is None:
            return None
        self._num_reported.pop(request_id, None)
        return request.metrics(self._take_cost(request_id))

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def close(self) -> None:
        """Stop what the executor started (the other tensor-parallel ranks, the KV fetcher's
        thread)."""
        fetcher = getattr(self.runner, "kv_fetcher", None)
        if fetcher is not None:
            fetcher.close()
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()
        if self.core.structured is not None:
            self.core.structured.close()
        if self.kv_events is not None:
            self.kv_events.close()

    @property
    def num_unscheduled(self) -> int:
        return self.core.num_unscheduled

    # -- the step (engine thread) ------------------------------------------------------------
    def step(self) -> EngineOutputs:
        """One pass of the model; an update for every request that advanced or ended, and the
        step's stats (no tokens when no pass ran)."""
        out: CoreOutput = self.core.step()
        fetcher = getattr(self.runner, "kv_fetcher", None)
        updates = []
        finished = {id(r) for r in out.finished}
        for request in out.advanced:
            if id(request) not in finished:
                updates.append(self._update(request, out, final=False))
        for request in out.finished:
            updates.append(self._update(request, out, final=True))
        stats = out.stats
        sched = self.scheduler
        kv = sched.kv
        if stats is None:  # no model pass: the queues may still have changed
            stats = StepStats(0, 0, 0, sched.num_running, sched.num_waiting, kv.usage, 0, 0.0,
                              kv.stats.queries, kv.stats.hits)  # fmt: skip
        elif self.accountant is not None:
            priced = self.accountant.last  # priced by its on_step, which ran with this step
            if priced is not None:
                mfu, mbu = self.accountant.utilization(priced)
                accountant = self.accountant
                usd = priced.measured_s * accountant.price_per_second
                stats.price = StepPrice(
                    priced.cost.predicted_s,
                    priced.measured_s,
                    priced.roofline_efficiency,
                    mfu,
                    mbu,
                    priced.cost.arithmetic_s,
                    priced.cost.movement_s,
                    usd if accountant.has_price else None,
                )
        if fetcher is not None and (
            self.kv_server is not None or fetcher.links or fetcher.num_failed
        ):
            stats.kv_transfer = self._kv_transfer_stats(fetcher)
        stats.kv_blocks_used = kv.num_blocks - kv.pool.num_free_blocks
        stats.kv_blocks_total = kv.num_blocks
        stats.num_tokens_in_flight = sum(r.num_tokens for r in sched.running) + sum(
            r.num_tokens for r in sched.waiting
        )
        if self.kv_events is not None:
            events = kv.pool.events.drain()
            if events:
                self.kv_events.publish(events)
        matchers = self.core.structured
        if matchers is not None and matchers.num_compiled:
            stats.structured = StructuredStats(
                matchers.num_compiled,
                matchers.compile_seconds,
                matchers.num_masks,
                matchers.mask_seconds,
                matchers.num_over_budget,
            )
        return EngineOutputs(updates, stats)

    def _kv_transfer_stats(self, fetcher) -> KVTransferStats:
        kv = self.scheduler.kv
        server = self.kv_server
        return KVTransferStats(
            fetches=fetcher.num_fetched,
            fetched_bytes=fetcher.bytes_fetched,
            fetch_failures=fetcher.num_failed,
            recomputes=self.core.num_kv_recomputes,
            transferred_prompt_tokens=self.scheduler.num_transferred_prompt_tokens,
            sends=0 if server is None else server.num_sent,
            sent_bytes=0 if server is None else server.bytes_sent,
            leases=len(kv.leases),
            lease_expiries=kv.num_lease_expiries,
        )

    def _take_cost(self, request_id: str):
        return None if self.accountant is None else self.accountant.take(request_id)

    def _update(self, request: Request, out: CoreOutput, final: bool) -> RequestUpdate:
        request_id = request.request_id
        sent = self._num_reported.get(request_id, 0)
        new_tokens = request.output_token_ids[sent:]
        logprobs = None
        if request.sampling_params.logprobs is not None and new_tokens:
            logprobs = out.logprobs.get(request_id)
        # Sent once, with the first update (the first token, or the end of a scoring request).
        scored = None
        if request_id not in self._num_reported and request.prompt_scored:
            scored = request.prompt_logprobs
        if final:
            self._num_reported.pop(request_id, None)
            cost = self._take_cost(request_id)
        else:
            self._num_reported[request_id] = request.num_output_tokens
            cost = None if self.accountant is None else self.accountant.peek(request_id)
        return RequestUpdate(
            request_id=request_id,
            new_token_ids=new_tokens,
            metrics=request.metrics(cost),
            new_logprobs=logprobs,
            prompt_logprobs=scored,
            finish_reason=request.finish_reason if final else None,
            stop_reason=request.stop_reason if final else None,
            error=request.error if final else None,
            error_param=request.error_param if final else None,
            kv_lease=self._lease_of(request) if final else None,
            embedding=self._embedding_of(request) if final else None,
        )

    @staticmethod
    def _embedding_of(request: Request) -> list[float] | None:
        params = request.sampling_params.pooling
        if params is None or request.pooled is None or request.finish_reason != "length":
            return None
        return finish_embedding(request.pooled, params)

    def _lease_of(self, request: Request) -> RemoteKV | None:
        """Where a decode instance fetches a leased request's prompt KV: this engine's KV
        link (quill/disagg/serve.py)."""
        lease = request.kv_lease
        if lease is None or self.kv_server is None:
            return None
        host, port = self.kv_server.address
        return RemoteKV(
            host,
            port,
            request.request_id,
            list(lease.block_ids),
            lease.num_tokens,
            request.output_token_ids[0],
        )


def _make_admission(config: EngineConfig, accountant, token_budget: int):
    """Predicts every request's TTFT (and refuses those past an SLO): priced by the cost model,
    corrected by the measured steps, when this machine has a hardware spec; else by a line fit
    of the measured steps against their token counts."""
    from quill.engine.admission import AdmissionControl, StepTimer

    cost_model = None if accountant is None else accountant.cost_model
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


def _make_spec_switch(speculative, accountant):
    """Speculation on only in steps where it pays: priced like admission's steps (the cost
    model fitted to measured steps, or a line in token counts without a hardware spec)."""
    from quill.engine.admission import StepTimer
    from quill.engine.spec_switch import SpeculationSwitch

    cost_model = None if accountant is None else accountant.cost_model
    timer = StepTimer.from_cost_model(cost_model) if cost_model else StepTimer.by_tokens()
    return SpeculationSwitch(speculative.num_speculative_tokens, timer)


def _make_accountant(config: EngineConfig, built):
    """Prices every step on the configured hardware, or this machine's saved calibration."""
    from quill.cost.hardware import HardwareSpec
    from quill.cost.live import CostAccountant
    from quill.cost.model import ModelSpec
    from quill.cost.step import CostModel

    bytes_per_param = read_bytes_per_param(built.runner.model, built.dtype.itemsize)
    model = ModelSpec.from_hf_config(built.hf_config, bytes_per_param=bytes_per_param)
    model.kv_bytes_per_element = built.kv_format.bytes_per_element  # the cache's, not the weights'
    if config.hardware is not None:
        hardware = HardwareSpec.resolve(config.hardware)
    else:
        hardware = _saved_calibration(config, built)
    if hardware is None:
        log.info(
            "cost: no hardware spec (--hardware, or run `quill cost calibrate` once); requests "
            "get FLOPs and bytes, steps get no roofline efficiency"
        )
        return CostAccountant(model, None, config.price_per_hour)
    log.info("cost: pricing steps on %s", hardware.name)
    return CostAccountant(model, CostModel(model, hardware), config.price_per_hour)


def _saved_calibration(config: EngineConfig, built):
    """This machine's calibration for the model as built: one whose key (freshness.py) is
    this process's, or a stale one refitted, refused or taken as it is."""
    from quill.cost import freshness
    from quill.cost.hardware import HardwareSpec

    dtype = str(built.dtype).removeprefix("torch.")
    key = freshness.current_key(freshness.weight_formats(built.runner.model))
    path, reasons = freshness.find(dtype, key)
    if path is None:
        return None
    if reasons:
        policy = config.calibration or freshness.default_policy()
        path = freshness.resolve_stale(
            path, reasons, policy, str(built.model_path), dtype, config.quantization or "none", key
        )
    return HardwareSpec.load(path)


def read_bytes_per_param(model, float_bytes: int) -> float:
    """The average bytes of a weight a pass reads: the weights used as a GGUF file stores
    them at their own bytes (quill/model/stored.py), the others at the model's dtype."""
    from quill.model.stored import StoredLinear

    stored = [m for m in model.modules() if isinstance(m, StoredLinear)]
    if not stored:
        return float(float_bytes)
    stored_bytes = sum(m.nbytes for m in stored)
    stored_params = sum(m.in_features * m.out_features for m in stored)
    tied = model.config.tie_word_embeddings  # a float table read whole, as the head
    floats = sum(
        p.numel()
        for name, p in model.named_parameters()
        if tied or not name.startswith("embed_tokens.")
    )
    return (stored_bytes + floats * float_bytes) / (stored_params + floats)


def _reply_matchers(built):
    """The matchers for structured output, over the model's tokenizer.json (None without one:
    constrained requests are then refused)."""
    path = Path(built.tokenizer_source)
    path = path / "tokenizer.json" if path.is_dir() else path
    if path.name != "tokenizer.json" or not path.is_file():
        log.info("structured output: off (no tokenizer.json at %s)", built.tokenizer_source)
        return None
    from quill.structured.grammar import Grammars
    from quill.structured.matchers import ReplyMatchers

    ends = sorted(built.tokenizer.eos_token_ids)
    try:
        grammars = Grammars(path, built.model_config.vocab_size, ends)
    except ValueError as e:  # a tokenizer the grammar library cannot read
        log.warning("structured output: off (the grammar library cannot read %s: %s)", path, e)
        return None
    return ReplyMatchers(grammars)
