"""The engine thread and its bridge to asyncio.

The engine steps in a thread of its own, so a model pass never blocks the event loop (torch
releases the GIL in its kernels). Handlers call `add` and `abort` from the event loop; the
engine queues them and applies them at the start of its next step, so requests that arrive
while a step runs join the next one. After each step, the outputs are handed to the event loop
in one `call_soon_threadsafe` and routed to each request's asyncio queue.

Detokenization still happens inside `engine.step()` (the engine owns the incremental
detokenizer); prompt tokenization and chat templating run in a worker thread, off both the
event loop and the engine's step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass

from quill.engine.llm_engine import LLMEngine
from quill.engine.outputs import RequestOutput
from quill.sampling_params import SamplingParams
from quill.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineFailure(Exception):
    """The engine could not serve a request (a failed step, or the engine stopped)."""


@dataclass
class _Sink:
    queue: asyncio.Queue  # receives (index, RequestOutput | EngineFailure)
    index: int


class AsyncEngine:
    """Runs an LLMEngine in a thread; per request, outputs arrive on an asyncio.Queue."""

    def __init__(self, engine: LLMEngine, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.metrics = metrics
        self._sinks: dict[str, _Sink] = {}  # touched by the event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = False
        self._draining = False
        self.error: BaseException | None = None  # set if the engine thread died

    # -- life cycle (event loop) -----------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="quill-engine", daemon=True)
        self._thread.start()

    def drain(self) -> None:
        """Refuse new requests and abort those in flight; their streams end with "abort"."""
        self._draining = True
        self.abort_all()

    async def stop(self, timeout: float = 10.0) -> None:
        """Drain, wait for the aborts to come back (one step), then end the engine thread."""
        self.drain()
        deadline = time.monotonic() + timeout
        while self._sinks and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._fail_all("the server is shutting down")
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    @property
    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def num_waiting(self) -> int:
        """Requests not yet scheduled: those the engine holds waiting plus those not yet drained."""
        return self.engine.num_unscheduled

    # -- requests (event loop) -------------------------------------------------------------
    def add(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        arrival_time: float,
        queue: asyncio.Queue,
        index: int,
        **scheduling,
    ) -> None:
        """Queue a request for the next step; raises InvalidRequestError for bad input, or
        OverloadedError when it would start past its TTFT SLO. `scheduling`: the engine's
        add_request keywords (priority, cache_salt, ttft_slo).

        Takes token ids: tokenizing is the caller's job, in a worker thread.
        """
        if not self.is_alive or self._draining:
            raise EngineFailure(
                "the server is shutting down" if self._draining else "the engine is not running"
            )
        # Registered first: the engine thread may finish a step with it before add returns.
        self._sinks[request_id] = _Sink(queue, index)
        try:
            self.engine.add_request(prompt, params, request_id, arrival_time, **scheduling)
        except BaseException:
            del self._sinks[request_id]
            raise
        self._wake.set()

    def abort(self, request_id: str) -> None:
        if request_id in self._sinks:
            self.engine.abort_request(request_id)
            self._wake.set()

    def abort_all(self) -> None:
        for request_id in list(self._sinks):
            self.abort(request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if out.finished:
                del self._sinks[out.request_id]
            sink.queue.put_nowait((sink.index, out))

    def _fail_all(self, message: str) -> None:
        """After a step raised: every request in flight gets the error and is aborted."""
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort_request(request_id)
            sink.queue.put_nowait((sink.index, EngineFailure(message)))
        self._sinks.clear()

    # -- the engine thread -----------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopping:
                self._wake.clear()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait()
                    continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - must reach the event loop, not vanish
            log.exception("the engine thread died")
            self.error = e
            self._post(self._fail_all, f"engine stopped: {type(e).__name__}: {e}")
            raise

    def _step(self) -> None:
        engine = self.engine
        before = engine.last_step
        accountant = engine.accountant
        try:
            outputs = engine.step()
        except Exception as e:
            # The engine already fails the requests of a step whose model pass raised; an
            # exception that escapes step() leaves its state unknown, so everything in flight
            # is failed and aborted, and the engine carries on with what comes next.
            log.exception("engine step failed")
            self._post(self._fail_all, f"engine step failed: {type(e).__name__}: {e}")
            time.sleep(0.01)  # a step that fails at once must not spin a core
            return
        sched = engine.scheduler
        if self.metrics is not None:
            stats = engine.last_step if engine.last_step is not before else None
            priced = accountant.last if stats is not None else None
            self.metrics.on_step(
                outputs,
                time.monotonic(),
                stats.num_batched_tokens if stats else None,
                stats.num_preemptions if stats else 0,
                sched.num_running,
                sched.num_waiting,
                sched.kv.usage,
                priced,
                accountant.utilization(priced) if priced is not None else None,
                (sched.kv.stats.queries, sched.kv.stats.hits),
            )
        if outputs:
            self._post(self._deliver, outputs)

    def _post(self, fn, *args) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(fn, *args)
            except RuntimeError:  # the loop closed in between: nobody is listening any more
                pass
