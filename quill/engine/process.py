"""The engine process of `quill serve`: an `EngineWorker` stepping in a process of its own.

Why a process: a step is ~1,200 small operators, each of which gives up and takes back the
interpreter lock; beside the HTTP event loop, the tokenizer and the metrics code in one
process, every one of them waited for the lock (one stream's inter-token gap was 1.8x the
offline step). Here the step loop has an interpreter to itself.

Messages (quill.contract.messages, bytes by quill.contract.codec) come in on a ZeroMQ PULL
socket and go out on a PUSH socket; the API process binds both. A receiving thread applies
adds and aborts at once (adds are answered at once: accepted, or why not; a constrained
request once its matcher is prepared on a grammar thread, so that a slow grammar holds up
nothing else) and wakes the step loop, which steps while there is work and otherwise blocks:
no spinning. Start-up goes
through a third socket: the `EngineInfo` once the model is loaded, or why it could not be.
It is started as `python -m quill.engine.process` (a fresh interpreter, never a fork of one
that holds torch's threads), its configuration as JSON on the command line.

The process ends when told to (a `shutdown` utility call), on SIGTERM (which the kernel sends
when the server process ends, however it ends: quill/lifetime.py), or when its parent is gone
(checked every half second): it never outlives the server. SIGINT is left to the parent,
which drains first and then tells it to stop.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
import traceback
from collections import deque

from quill.config import EngineConfig
from quill.contract.codec import Codec
from quill.contract.errors import ExecutorFailedError, InvalidRequestError, OverloadedError
from quill.contract.messages import (
    AbortRequests,
    AddResult,
    EngineFailed,
    EngineOutputs,
    EngineRequest,
    ErrorInfo,
    UtilityCall,
    UtilityResult,
)

log = logging.getLogger(__name__)

_ORPHAN_GRACE_S = 2.0  # an engine whose server is gone ends within this, however it closes


def main(argv: list[str] | None = None) -> int:
    """`python -m quill.engine.process CONFIG_JSON INPUT OUTPUT STARTUP LOG_LEVEL`."""
    import zmq

    config_json, input_address, output_address, startup_address, log_level = argv or sys.argv[1:]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the server drains first, then stops us
    level = log_level.upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s (engine): %(message)s"))
    logger = logging.getLogger("quill")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    parent = os.getppid()
    codec = Codec()
    context = zmq.Context()
    startup = context.socket(zmq.PUSH)
    startup.setsockopt(zmq.LINGER, 5000)
    startup.connect(startup_address)
    try:
        from quill.engine.worker import EngineWorker

        worker = EngineWorker(EngineConfig(**json.loads(config_json)))
    except BaseException as e:  # noqa: BLE001 - the parent must learn why, then we exit
        log.exception("the engine could not start")
        startup.send(codec.encode(EngineFailed(f"{type(e).__name__}: {e}")))
        startup.close()
        context.term()
        return 1
    loop = EngineLoop(worker, input_address, output_address, parent)
    signal.signal(signal.SIGTERM, lambda *_: loop.stop())
    startup.send(codec.encode(worker.info))
    startup.close()
    context.term()
    return loop.run()


class EngineLoop:
    """Receives on one thread, steps on the main one, sends from both (under a lock)."""

    def __init__(self, worker, input_address: str, output_address: str, parent_pid: int) -> None:
        import zmq

        self.worker = worker
        self.parent_pid = parent_pid
        self._zmq = zmq.Context()
        self._in = self._zmq.socket(zmq.PULL)
        self._in.connect(input_address)
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 1000)
        self._out.connect(output_address)
        self._send_lock = threading.Lock()
        self._send_codec = Codec()
        self._wake = threading.Event()
        self._stopping = False
        self._paused = False
        self._calls: deque[UtilityCall] = deque()  # run by the step thread, between steps
        self._faults: dict[str, int] = {}  # tests: site -> the call that raises
        if worker.kv_server is not None:  # a fetched lease is freed at the next step
            worker.kv_server.on_release = self._wake.set
        self._kv_transfer_sent = None  # the last KVTransferStats sent
        # Constrained requests whose matcher is being prepared: id -> (future, deadline).
        self._preparing: dict[str, tuple] = {}
        self._preparing_lock = threading.Lock()

    # -- both threads ----------------------------------------------------------------------
    def send(self, message) -> None:
        with self._send_lock:
            self._out.send(self._send_codec.encode(message), copy=False)

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()

    # -- the receiving thread --------------------------------------------------------------
    def _receive(self) -> None:
        codec = Codec()
        try:
            while not self._stopping:
                self._expire_preparations()
                if not self._in.poll(200):
                    continue
                message = codec.decode(self._in.recv(copy=False).buffer)
                if isinstance(message, EngineRequest):
                    self._receive_request(message)
                elif isinstance(message, AbortRequests):
                    for request_id in message.request_ids:
                        if not self._unprepare(request_id, "it was aborted"):
                            self.worker.abort(request_id, message.reason)
                elif isinstance(message, UtilityCall):
                    if message.name == "resume":
                        self._paused = False
                        self.send(UtilityResult(message.call_id))
                    elif message.name == "shutdown":
                        self.send(UtilityResult(message.call_id))
                        self.stop()
                    else:
                        self._calls.append(message)
                self._wake.set()
        except BaseException as e:  # noqa: BLE001 - a dead receiver must end the process
            log.exception("the engine's receiving thread died")
            self.fail(f"the engine's receiver failed: {type(e).__name__}: {e}", fatal=True)

    def _receive_request(self, req: EngineRequest) -> None:
        """Add a request and answer; a constrained one once its matcher is prepared (on a
        grammar thread: this thread goes on receiving meanwhile)."""
        try:
            future = self.worker.prepare(req)
        except InvalidRequestError as e:
            self.send(AddResult(req.request_id, ErrorInfo("invalid", e.message, e.param)))
            return
        if future is None:
            self.send(self._add(req))
            return
        deadline = time.monotonic() + self.worker.core.structured.prepare_timeout_s
        with self._preparing_lock:
            self._preparing[req.request_id] = (future, deadline)
        future.add_done_callback(lambda done: self._prepared(req, done))

    def _prepared(self, req: EngineRequest, future) -> None:
        """A grammar thread finished preparing `req`: add it, unless it was aborted or timed
        out meanwhile (it was answered then)."""
        with self._preparing_lock:
            if self._preparing.pop(req.request_id, None) is None:
                return
        try:
            prepared = future.result()
        except InvalidRequestError as e:
            self.send(AddResult(req.request_id, ErrorInfo("invalid", e.message, e.param)))
        except Exception as e:  # noqa: BLE001 - the request fails, the engine serves on
            log.exception("preparing request %s failed", req.request_id)
            self.send(AddResult(req.request_id, ErrorInfo("engine", f"{type(e).__name__}: {e}")))
        else:
            self.send(self._add(req, prepared))
        self._wake.set()

    def _unprepare(self, request_id: str, why: str, error: Exception | None = None) -> bool:
        """Answer a request still being prepared with why it was not added; False if it is
        not being prepared."""
        with self._preparing_lock:
            entry = self._preparing.pop(request_id, None)
        if entry is None:
            return False
        entry[0].cancel()
        error = error or InvalidRequestError(f"the request was not added: {why}")
        self.send(AddResult(request_id, ErrorInfo("invalid", str(error), error.param)))
        return True

    def _expire_preparations(self) -> None:
        now = time.monotonic()
        with self._preparing_lock:
            late = [rid for rid, (_, deadline) in self._preparing.items() if now > deadline]
        for request_id in late:
            self._unprepare(request_id, "", self.worker.core.structured.timed_out())

    def _add(self, req: EngineRequest, prepared=None) -> AddResult:
        try:
            self.worker.add(req, prepared=prepared)
        except InvalidRequestError as e:
            return AddResult(req.request_id, ErrorInfo("invalid", e.message, e.param))
        except OverloadedError as e:
            return AddResult(
                req.request_id, ErrorInfo("overloaded", e.message, retry_after=e.retry_after)
            )
        except Exception as e:  # noqa: BLE001 - the request fails, the engine serves on
            log.exception("adding request %s failed", req.request_id)
            return AddResult(req.request_id, ErrorInfo("engine", f"{type(e).__name__}: {e}"))
        return AddResult(req.request_id, warnings=list(prepared.warnings) if prepared else [])

    def _watch_parent(self) -> None:
        while True:
            if os.getppid() != self.parent_pid:
                log.error("the server process is gone; the engine stops")
                self.stop()
                # Nobody is left to hear a clean stop: if closing hangs (a thread that does
                # not end), end the process anyway, as the kernel's signal means it to.
                time.sleep(_ORPHAN_GRACE_S)
                os._exit(1)
            time.sleep(0.5)

    # -- the step thread -------------------------------------------------------------------
    def run(self) -> int:
        self._receiver = threading.Thread(
            target=self._receive, name="quill-engine-receive", daemon=True
        )
        self._receiver.start()
        threading.Thread(target=self._watch_parent, name="quill-engine-parent", daemon=True).start()
        worker = self.worker
        try:
            while not self._stopping:
                self._wake.clear()
                while self._calls:
                    self._run_call(self._calls.popleft())
                if self._paused or not worker.has_unfinished_requests():
                    expiry = worker.core.next_lease_expiry()
                    if expiry is None or self._paused:
                        self._wake.wait()
                        continue
                    # Idle but holding KV leases: wake to free them when they end.
                    if self._wake.wait(max(0.0, expiry - worker.clock.now())):
                        continue
                self._step()
        except BaseException as e:  # noqa: BLE001 - the server must hear of it, then we exit
            log.exception("the engine loop died")
            self.fail(f"the engine stopped: {type(e).__name__}: {e}", fatal=True)
            return 1
        finally:
            self._close()
            self.worker.close()
        return 0

    def _step(self) -> None:
        try:
            self._maybe_fault("step")
            out: EngineOutputs = self.worker.step()
        except ExecutorFailedError:
            raise  # the model cannot run any more: the loop ends, the server hears it is fatal
        except Exception as e:
            # A step that raised leaves its requests' state unknown: the front end fails and
            # aborts everything in flight, and the engine carries on with what comes next.
            log.exception("engine step failed")
            self.fail(f"engine step failed: {type(e).__name__}: {e}", fatal=False)
            time.sleep(0.01)  # a step that fails at once must not spin a core
            return
        kv_transfer = out.stats.kv_transfer  # a lease freed, a fetch failed: news without tokens
        if out.updates or out.stats.num_batched_tokens or kv_transfer != self._kv_transfer_sent:
            self.send(out)
            self._kv_transfer_sent = kv_transfer

    def fail(self, message: str, fatal: bool) -> None:
        try:
            self.send(EngineFailed(message, fatal))
        except Exception:  # noqa: BLE001 - the socket may be what failed
            log.exception("could not tell the server")

    def _run_call(self, call: UtilityCall) -> None:
        try:
            value = getattr(self, f"_call_{call.name}")(*call.args)
        except Exception as e:  # noqa: BLE001 - the caller gets the error
            self.send(UtilityResult(call.call_id, error=f"{type(e).__name__}: {e}"))
            return
        self.send(UtilityResult(call.call_id, value))

    def _call_state(self) -> dict:
        sched = self.worker.scheduler
        kv = sched.kv
        return {
            "num_running": sched.num_running,
            "num_waiting": sched.num_waiting,
            "num_unscheduled": self.worker.num_unscheduled,
            "kv_cache_usage": kv.usage,
            "kv_blocks_used": kv.num_blocks - kv.pool.num_free_blocks,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queries": kv.stats.queries,
            "prefix_cache_hits": kv.stats.hits,
            # First-group blocks the prefix cache holds: those KV-cache events tell of.
            "prefix_cached_blocks": sum(1 for h in kv.pool.cached if type(h) is not tuple),
            "pid": os.getpid(),
        }

    def _call_cores(self, cpus: list[int]) -> int:
        """Run on `cpus` from the next step on: every thread of this process pinned to them,
        one compute thread each (a multi-model server keeps its loaded models to half the
        cores while another loads, quill/server/models/pool.py). Returns the compute threads."""
        import torch

        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), cpus)
            except OSError:  # a thread that ended meanwhile
                pass
        torch.set_num_threads(len(cpus))
        return torch.get_num_threads()

    def _call_pause(self) -> None:
        """Stop stepping (requests still come in) until "resume"."""
        self._paused = True

    def _call_inject_fault(self, site: str, after: int) -> None:
        """Tests: the `after`-th next call at `site` ("step": the whole step, "execute": the
        model pass) raises RuntimeError("injected fault")."""
        if site == "execute":
            runner = self.worker.core.executor
            real = runner.execute
            calls = [0]

            def execute(plan):
                calls[0] += 1
                if calls[0] == after:
                    runner.execute = real
                    raise RuntimeError("injected fault")
                return real(plan)

            runner.execute = execute
        elif site == "step":
            self._faults[site] = after
        else:
            raise ValueError(f"unknown fault site {site!r}")

    def _maybe_fault(self, site: str) -> None:
        left = self._faults.get(site)
        if left is None:
            return
        if left <= 1:
            del self._faults[site]
            raise RuntimeError("injected fault")
        self._faults[site] = left - 1

    def _close(self) -> None:
        self._stopping = True
        self._receiver.join(2)  # it polls with a timeout: it sees the flag and returns
        try:
            self._out.close(linger=1000)
            self._in.close(linger=0)
            self._zmq.term()
        except Exception:  # noqa: BLE001 - closing on the way out
            traceback.print_exc()


if __name__ == "__main__":
    sys.exit(main())
