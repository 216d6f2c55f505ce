"""The engine core: queue, schedule, execute a step plan, apply the result. No torch.

The core does not know whether a model is real. It is handed an executor (the torch model
runner, or the simulator's cost-model executor) and a clock (wall or virtual), so the same loop
serves requests and simulates traffic, and the timings it stamps on requests mean the same in
both. Text (tokenizing, detokenizing, stop strings) lives in the front end around it.

`add_request` and `abort_request` are safe from other threads: they queue the change for the
next step. `step` runs in one thread only.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field, replace

from quill.contract.errors import ExecutorFailedError, InvalidRequestError
from quill.contract.messages import SpecDecodeStats, StepStats
from quill.contract.plan import Executor, SampleLogprobs, SeqPlan, StepPlan, StepResult
from quill.engine.admission import AdmissionControl, QueueState
from quill.engine.clock import WallClock
from quill.engine.plan_builder import kv_fetches, seq_plans
from quill.engine.prompt_scoring import gather_pooled, gather_prompt_logprobs
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass
class CoreOutput:
    """A step's effect on requests. A request that got its last token is in both lists."""

    advanced: list[Request] = field(default_factory=list)  # got a new token this step
    finished: list[Request] = field(default_factory=list)  # ended (any reason, errors too)
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    stats: StepStats | None = None  # set when a model pass ran


class EngineCore:
    """Continuous batching around one executor; see the scheduler for the policy."""

    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        clock=None,
        step_listeners=(),
        admission: AdmissionControl | None = None,
        recompute_failed_fetches: bool = True,
        structured=None,
    ) -> None:
        """`recompute_failed_fetches`: a request whose prompt KV could not be fetched from a
        prefill instance computes its prompt here (else it fails). `structured`: the
        `ReplyMatchers` that enforce constraints (None: requests with one are refused)."""
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock or WallClock()
        # Told of every step run, after it ran: `.on_step(plan, start, end)` (recorders, costs).
        self.step_listeners = list(step_listeners)
        # Predicts each request's TTFT as it is added (and refuses it past an SLO).
        self.admission = admission
        self._queue_state = QueueState()
        # Requests the scheduler took after the last snapshot: the snapshot does not hold them
        # yet, and they are no longer pending (cleared when the next snapshot is taken).
        self._unsnapshotted: list[Request] = []
        self._step_started: float | None = None  # when the step now running began
        if admission is not None:
            self.step_listeners.append(admission)
        self._pending: deque[tuple[str, object]] = deque()
        self._lock = threading.Lock()
        self._live_ids: set[str] = set()
        self._ended_ids: list[str] = []  # for the next plan's finished_request_ids
        self._next_step_id = 0
        self.last_step: StepStats | None = None
        self.last_plan: StepPlan | None = None  # what the last pass that ran computed
        self.recompute_failed_fetches = recompute_failed_fetches
        self.num_kv_recomputes = 0
        self.structured = structured

    @property
    def max_model_len(self) -> int:
        return self.scheduler.max_model_len

    def set_token_budget(self, num_tokens: int) -> None:
        """Tokens per step from the next step on (measuring code varies it between steps)."""
        if num_tokens < 1:
            raise ValueError(f"the token budget must be positive, got {num_tokens}")
        self.scheduler.token_budget = num_tokens
        if self.admission is not None:
            self.admission.token_budget = num_tokens

    # -- requests (any thread) -------------------------------------------------------------
    def add_request(self, request: Request, prepared=None) -> None:
        """Validate and queue a request for the next step; raises InvalidRequestError, or
        OverloadedError when admission control predicts it would start past its SLO.
        `prepared`: a constrained request's matcher (`ReplyMatchers.prepare`), made first."""
        self.scheduler.check_request(request)
        if request.sampling_params.structured is not None:
            self.check_structured()
            if prepared is None:
                raise ValueError("a constrained request is added with its prepared matcher")
        if request.ttft_slo is not None and self.admission is None:
            raise InvalidRequestError(
                "ttft_slo needs TTFT prediction, which this engine runs without "
                "(started with --no-predict-ttft)",
                "ttft_slo",
            )
        kv = self.scheduler.kv
        with self._lock:
            if request.request_id in self._live_ids:
                raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
            if self.admission is not None:
                pending = [item for kind, item in self._pending if kind == "add"]
                pending += self._unsnapshotted
                num_cached = len(kv.find_cached_prefix(request)[0]) * kv.block_size
                started = self._step_started
                elapsed = None if started is None else self.clock.now() - started
                self.admission.admit(request, num_cached, self._queue_state, pending, elapsed)
            self._live_ids.add(request.request_id)
            if prepared is not None:
                self.structured.attach(request.request_id, prepared)
            self._pending.append(("add", request))

    def check_structured(self) -> None:
        """Refuse constrained requests when this engine cannot enforce constraints."""
        if self.structured is None:
            raise InvalidRequestError(
                "structured output needs the model's tokenizer.json beside its weights",
                "structured",
            )

    def _token_mask(self, request: Request) -> bytes | None:
        """The tokens a sampling request may take next: its grammar's, or one alone where
        its thinking budget forces the end-of-thinking marker (its grammar, if any, allows
        that marker and takes it after)."""
        forced = request.forced_thinking_token()
        if forced is not None:
            mask = bytearray(forced // 8 + 1)
            mask[forced // 8] = 1 << (forced % 8)
            return bytes(mask)
        if request.sampling_params.structured is None:
            return None
        return self.structured.bitmask(request.request_id)

    def release_kv(self, request_id: str) -> None:
        """Free a finished request's leased KV blocks at the next step (the decode instance
        has them, or gave up)."""
        with self._lock:
            self._pending.append(("release", request_id))

    def abort_request(self, request_id: str, reason: str = "abort", stop_reason=None) -> None:
        """End a request at the next step: "abort", or "stop" with the stop string the front
        end found."""
        with self._lock:
            self._pending.append(("abort", (request_id, reason, stop_reason)))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    def next_lease_expiry(self) -> float | None:
        """When the first KV lease ends (a step then frees it), on this core's clock."""
        leases = self.scheduler.kv.leases
        return min(lease.expires_at for lease in leases.values()) if leases else None

    @property
    def has_pending(self) -> bool:
        """Adds, aborts or releases sent in and not yet taken (the next step takes them)."""
        return bool(self._pending)

    def take_pending_adds(self) -> bool:
        """Move the queued adds into the scheduler's queue now, as the next step would before
        anything else (the simulator's fast-forward does, so that adds queued while the batch
        is full cost no step of their own); False, with nothing moved, while an abort or a
        release is queued too (a step takes those)."""
        with self._lock:
            if any(kind != "add" for kind, _ in self._pending):
                return False
            adds = [request for _, request in self._pending]
            self._pending.clear()
            if self.admission is not None:
                self._unsnapshotted += adds
        for request in adds:
            self.scheduler.add_request(request)
        return True

    @property
    def num_unscheduled(self) -> int:
        """Requests waiting for their first step: queued adds plus the scheduler's waiting."""
        with self._lock:
            queued = sum(1 for kind, _ in self._pending if kind == "add")
        return queued + self.scheduler.num_waiting

    # -- the step (engine thread) ------------------------------------------------------------
    def finish_request(
        self, request_id: str, reason: str, stop_reason=None, error: str | None = None
    ) -> Request | None:
        """End a request now (a stop string found by the front end, an abort, an error). An
        abort of a request already ended frees the KV blocks it leased."""
        request = self.scheduler.finish_request(request_id, reason, stop_reason, self.clock.now())
        if request is not None:
            self._ended(request, error)
        elif reason == "abort":
            self.scheduler.kv.release(request_id)
        return request

    def _ended(self, request: Request, error: str | None = None) -> None:
        request.times.finished = self.clock.now()
        request.error = error
        if self.structured is not None and request.sampling_params.structured is not None:
            self.structured.drop(request.request_id)
        self._ended_ids.append(request.request_id)
        with self._lock:
            self._live_ids.discard(request.request_id)

    def _drain_pending(self, out: CoreOutput) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                kind, item = self._pending.popleft()
            if kind == "release":
                self.scheduler.kv.release(item)
            elif kind == "add":
                self.scheduler.add_request(item)
                if self.admission is not None:
                    with self._lock:
                        self._unsnapshotted.append(item)
            else:
                request = self.finish_request(*item)
                if request is not None:
                    out.finished.append(request)

    def step(self) -> CoreOutput:
        """One pass of the model over whatever the scheduler picks.

        If the pass raises, only the requests that also fail on their own are failed (finish
        reason "error"); the others advance as if nothing had happened.
        """
        out = CoreOutput()
        self._drain_pending(out)
        start = self._step_started = self.clock.now()
        kv = self.scheduler.kv
        if kv.leases:
            for request_id in kv.expire_leases(start):
                log.warning("KV lease of %s expired: no decode instance fetched it", request_id)
        try:
            return self._step(out, start)
        finally:
            self._step_started = None
            if self.admission is not None:
                state = self.admission.snapshot(self.scheduler)
                with self._lock:
                    self._queue_state = state
                    self._unsnapshotted = []

    def _step(self, out: CoreOutput, start: float) -> CoreOutput:
        sched = self.scheduler.schedule(start)
        for request in sched.finished:
            self._ended(request)
            out.finished.append(request)
        if sched.is_empty and not self.scheduler.num_fetching:
            return out
        plan = self.make_plan(sched)
        if not plan.seqs:  # only KV fetches to start or to hear of: no pass
            self._fetches_ended(self._execute_fetches(plan), out)
            return out
        result, ran, errors = self._execute(plan)
        end = self.clock.now()
        self._fetches_ended(result, out)
        for request_id, error in errors.items():
            request = self.finish_request(request_id, "error", error=error)
            if request is not None:
                out.finished.append(request)
        if ran is None:
            return out
        if result.prompt_logprobs:
            gather_prompt_logprobs(sched, result.prompt_logprobs)
        if result.pooled:
            gather_pooled(sched, result.pooled)
        # Failed requests are finished by now, so `update` passes over them.
        advanced, finished = self.scheduler.update(sched, result.sampled, end)
        if self.structured is not None:
            finished += self._take_constrained(advanced, finished)
        if sched.finished:  # `update` hands these back again; they were reported above
            ended_earlier = {id(r) for r in sched.finished}
            finished = [r for r in finished if id(r) not in ended_earlier]
        for request in finished:
            self._ended(request, request.error)  # set by _take_constrained, else None
        out.advanced += advanced
        out.finished += finished
        out.logprobs = result.logprobs
        num_tokens, num_decode = ran.token_counts()
        kv = self.scheduler.kv
        out.stats = self.last_step = StepStats(
            num_prefill_tokens=num_tokens - num_decode,
            num_decode_tokens=num_decode,
            num_scheduled_requests=len(ran.seqs),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=kv.usage,
            num_preemptions=len(sched.preempted),
            duration=end - start,
            prefix_cache_queries=kv.stats.queries,
            prefix_cache_hits=kv.stats.hits,
            spec_decode=self._spec_snapshot(),
        )
        self.last_plan = ran
        for listener in self.step_listeners:
            listener.on_step(ran, start, end)

        return out

    def _spec_snapshot(self) -> SpecDecodeStats | None:
        spec = self.scheduler.spec_stats
        if self.scheduler.speculative is None:
            return None
        return replace(spec, accepted_per_position=spec.accepted_per_position[:])

    def _take_constrained(self, advanced: list[Request], finished: list[Request]) -> list[Request]:
        """Each constrained request's matcher takes its new tokens; a grammar that fails (a
        token it refuses, a parser limit, a mask over its budget) ends the request in error,
        the request's own (its grammar's), not the engine's. Returns those ended here."""
        ended, done = [], {id(r) for r in finished}
        for request in advanced:
            if request.sampling_params.structured is None:
                continue
            why = self.structured.take(request.request_id, request.output_token_ids)
            if why is not None and id(request) not in done:
                log.warning("%s: %s", request.request_id, why)
                if self.scheduler.finish_request(request.request_id, "error") is not None:
                    request.error, request.error_param = why, "structured"
                    ended.append(request)
        return ended

    def _execute_fetches(self, plan: StepPlan) -> StepResult:
        """A plan of fetches alone: the executor starts them and waits a little for any to
        end. If it raises, the fetches it was given fail (the others are still its own)."""
        try:
            return self.executor.execute(plan)
        except ExecutorFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - those requests fail, the engine goes on
            log.error("starting KV fetches failed", exc_info=e)
            self._ended_ids[:0] = plan.finished_request_ids
            failed = {f.request_id: f"{type(e).__name__}: {e}" for f in plan.kv_fetches}
            return StepResult({}, kv_fetch_failed=failed)

    def _fetches_ended(self, result: StepResult, out: CoreOutput) -> None:
        """Requests whose KV arrived join the running ones; those whose fetch failed compute
        their prompt here or fail (`recompute_failed_fetches`)."""
        scheduler = self.scheduler
        for request_id, moved in result.kv_fetched.items():
            request = scheduler.fetched(request_id)
            if request is not None:
                request.kv_transfer = moved
        for request_id, why in result.kv_fetch_failed.items():
            request = scheduler.fetch_failed(request_id)
            if request is None:
                continue
            error = f"KV transfer failed: {why}"
            if self.recompute_failed_fetches:
                log.warning("%s; computing its prompt here instead", error)
                scheduler.recompute(request_id)
                self.num_kv_recomputes += 1
                continue
            self.finish_request(request_id, "error", error=error)
            out.finished.append(request)

    def _execute(self, plan: StepPlan) -> tuple[StepResult, StepPlan | None, dict[str, str]]:
        """Runs the plan; if it raises, runs its sequences one at a time to find the culprits.

        Returns the merged result, the plan of the sequences that ran (None if none did), and
        an error message for each request that failed on its own. Redoing a sequence is safe:
        the KV cache writes are idempotent, as the failed pass wrote keys and values only for
        the same tokens, at the same positions, into the same slots that the retry writes
        again (and a failed request's blocks are freed); the sampler puts a seeded request's
        generator back when it raises, so the retry draws what the first pass would have.
        """
        try:
            return self.executor.execute(plan), plan, {}
        except ExecutorFailedError:  # the executor itself is gone: no retry can run
            raise
        except Exception as e:  # one bad request must not take the step, or the engine, down
            batch_error = e
        if len(plan.seqs) == 1:
            failures = [(plan.seqs[0], batch_error)]
            ran_seqs = []
            merged = StepResult({}, {})
        else:
            failures, ran_seqs, merged = self._retry_one_by_one(plan)
        errors = {s.request_id: f"{type(e).__name__}: {e}" for s, e in failures}
        if failures:
            log.error(
                "step %d failed; failing request(s) %s (%d other sequence(s) ran on their own)",
                plan.step_id,
                ", ".join(errors),
                len(ran_seqs),
                exc_info=failures[0][1],
            )
        else:
            log.warning(
                "step %d failed, yet each of its sequences ran on its own; no request failed",
                plan.step_id,
                exc_info=batch_error,
            )
        if not ran_seqs:
            # No pass got through, so the executor may not have heard of these: tell it again
            # next step (dropping a request's state twice is harmless).
            self._ended_ids[:0] = plan.finished_request_ids
            return merged, None, errors
        return merged, StepPlan(plan.step_id, ran_seqs, plan.finished_request_ids), errors

    def _retry_one_by_one(
        self, plan: StepPlan
    ) -> tuple[list[tuple[SeqPlan, Exception]], list[SeqPlan], StepResult]:
        failures: list[tuple[SeqPlan, Exception]] = []
        ran: list[SeqPlan] = []
        merged = StepResult({}, {})
        # The failed pass may have stopped before the executor dropped the state of ended
        # requests: retries carry their ids until one gets through.
        ended = plan.finished_request_ids
        for seq in plan.seqs:
            try:
                result = self.executor.execute(StepPlan(plan.step_id, [seq], ended))
            except ExecutorFailedError:
                raise
            except Exception as e:
                failures.append((seq, e))
                continue
            ended = []
            ran.append(seq)
            merged.sampled.update(result.sampled)
            merged.logprobs.update(result.logprobs)
            merged.prompt_logprobs.update(result.prompt_logprobs)
            merged.pooled.update(result.pooled)
            merged.kv_fetched.update(result.kv_fetched)
            merged.kv_fetch_failed.update(result.kv_fetch_failed)
        return failures, ran, merged

    def make_plan(self, sched: SchedulerOutput) -> StepPlan:
        """The scheduler's decision as plain data (block tables copied, since they grow later,
        unless the executor says it reads none: `reads_block_tables = False`)."""
        tables = self.scheduler.kv.block_tables
        copy_tables = getattr(self.executor, "reads_block_tables", True)
        seqs = seq_plans(sched.scheduled, tables, copy_tables, self._token_mask)
        fetches = kv_fetches(sched.fetches, tables)
        ended, self._ended_ids = self._ended_ids, []
        plan = StepPlan(self._next_step_id, seqs, ended, fetches)
        self._next_step_id += 1
        return plan
