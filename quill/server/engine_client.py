"""The API process's side of the engine: starts the engine process, talks to it, watches it.

`start_process` (before the event loop) starts quill/engine/process.py and waits until the
model is loaded: the engine's `EngineInfo` gives the front end
its tokenizer, vocabulary and context. `start` (in the event loop) opens the sockets: adds,
aborts and utility calls go out, and a reader task routes each step's `EngineOutputs` through
the output processor (text, stop strings) to the request's asyncio queue and the metrics.

The engine process is watched through a pidfd: if it dies (out of memory, a crash in a
native kernel, kill -9), every request in flight ends at once with an `EngineFailure`,
`is_alive` turns false (/health answers 503), and `on_death` tells the server to exit non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from quill.config import EngineConfig
from quill.contract.codec import Codec
from quill.contract.errors import InvalidRequestError, OverloadedError
from quill.contract.messages import (
    AbortRequests,
    AddResult,
    EngineFailed,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    UtilityCall,
    UtilityResult,
)
from quill.contract.outputs import RequestMetrics
from quill.frontend.inputs import InputProcessor
from quill.frontend.outputs import OutputProcessor
from quill.frontend.tokenizer import Tokenizer
from quill.lifetime import child_setup
from quill.server.cores import split_cores

log = logging.getLogger(__name__)

_SEND_TIMEOUT_MS = 5000


class EngineFailure(Exception):
    """The engine could not serve a request (a failed step, or the engine is gone)."""


@dataclass
class _Sink:
    queue: asyncio.Queue  # receives (index, RequestOutput | EngineFailure)
    index: int
    started: bool = False  # an output has arrived (the request is no longer waiting)


class EngineClient:
    """One engine process and the requests this server sent it."""

    def __init__(
        self, config: EngineConfig, metrics=None, log_level: str = "info", api_core: str = "auto"
    ) -> None:
        self.config = config
        self.api_cpus, self.engine_cpus = split_cores(api_core)
        self.metrics = metrics
        self.log_level = log_level
        self.info: EngineInfo | None = None
        self.tokenizer: Tokenizer | None = None
        self.inputs: InputProcessor | None = None
        self.outputs: OutputProcessor | None = None
        self.on_death = None  # called with the exit message once the engine process died
        self.error: str | None = None  # why the engine is gone
        self._process: subprocess.Popen | None = None
        self._pidfd: int | None = None  # readable once the engine process has ended
        self._dir = tempfile.mkdtemp(prefix="quill-engine-")
        self._to_engine = f"ipc://{self._dir}/in"
        self._from_engine = f"ipc://{self._dir}/out"
        self._sinks: dict[str, _Sink] = {}  # touched by the event loop only
        self._adds: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._read_codec = Codec()
        self._draining = False
        self._stopped = False
        self._codec = Codec()

    # -- start-up (before the event loop) --------------------------------------------------
    def start_process(self, timeout: float = 600.0) -> EngineInfo:
        """Start the engine process and wait until its model is loaded; RuntimeError if it
        could not start (its message names why)."""
        import zmq

        startup_address = f"ipc://{self._dir}/startup"
        context = zmq.Context()
        startup = context.socket(zmq.PULL)
        startup.setsockopt(zmq.LINGER, 0)
        startup.bind(startup_address)
        config = json.dumps(dataclasses.asdict(self.config))
        started = time.monotonic()
        engine_cpus = self.engine_cpus
        self._process = subprocess.Popen(
            [sys.executable, "-m", "quill.engine.process", config, self._to_engine,
             self._from_engine, startup_address, self.log_level],
            # Before the child starts: its compute threads are counted from its affinity; and
            # it ends when this process does, however that ends (quill/lifetime.py).
            preexec_fn=child_setup(signal.SIGTERM, engine_cpus),
        )  # fmt: skip
        if self.api_cpus:
            os.sched_setaffinity(0, self.api_cpus)
        message = None
        try:
            while message is None:
                if startup.poll(500):
                    message = self._codec.decode(startup.recv())
                elif self._process.poll() is not None:
                    break
                elif time.monotonic() - started > timeout:
                    self._process.kill()
                    raise RuntimeError(f"the engine did not start within {timeout:.0f} s")
        finally:
            startup.close()
            context.term()
        if not isinstance(message, EngineInfo):
            code = self._process.wait(10)
            why = message.message if isinstance(message, EngineFailed) else "it exited"
            raise RuntimeError(f"the engine process could not start ({why}; exit code {code})")
        self.info = message
        self.tokenizer = Tokenizer.load(
            Path(message.tokenizer_source).expanduser(), message.eos_token_ids
        )
        self.inputs = InputProcessor(self.tokenizer, message.vocab_size, message.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self._on_stop)
        log.info(
            "engine process %d ready in %.1f s; cores: %s",
            self._process.pid,
            time.monotonic() - started,
            "shared by the API and the engine"
            if not self.api_cpus
            else f"API process on {sorted(self.api_cpus)}, engine on {sorted(self.engine_cpus)}",
        )
        return message

    # -- life cycle (event loop) -----------------------------------------------------------
    async def start(self) -> None:
        import zmq

        self._loop = asyncio.get_running_loop()
        # Plain sockets read from the event loop's own epoll (their FD signals "look again";
        # each wake-up drains every message waiting): a message costs no future or task.
        self._zmq = zmq.Context()
        self._out = self._zmq.socket(zmq.PUSH)
        self._out.setsockopt(zmq.LINGER, 0)
        # A send blocks while no engine is connected: bounded, so that a server whose engine
        # died between a check and a send stops instead of hanging (seen: a replica whose
        # engine ended first blocked forever saying goodbye to it).
        self._out.setsockopt(zmq.SNDTIMEO, _SEND_TIMEOUT_MS)
        self._out.bind(self._to_engine)
        self._in = self._zmq.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._in.bind(self._from_engine)
        self._zmq_fd = self._in.getsockopt(zmq.FD)
        self._loop.add_reader(self._zmq_fd, self._drain_messages)
        self._loop.call_soon(self._drain_messages)
        self._pidfd = os.pidfd_open(self._process.pid)
        self._loop.add_reader(self._pidfd, self._on_exit)

    def drain(self) -> None:
        """Refuse new requests and abort those in flight; their streams end with "abort"."""
        self._draining = True
        self.abort_all()

    async def stop(self, timeout: float = 10.0, idle: bool = False) -> None:
        """Drain, wait for the aborts to come back (one step), then stop the engine process.
        `idle`: nothing is in flight and nothing need be said goodbye to (a multi-model
        server unloading an idle model for another's room): the process is killed at once,
        its memory back before the next model loads."""
        self.drain()
        deadline = time.monotonic() + timeout
        while self._sinks and self.is_alive and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._fail_all("the server is shutting down")
        if idle and self._process is not None and self._process.poll() is None:
            self._process.kill()
        elif self.is_alive:
            try:
                await asyncio.wait_for(self.call("shutdown"), 5)
            except (TimeoutError, EngineFailure):
                pass
        self._stopped = True
        await asyncio.to_thread(self.join, timeout)
        shutil.rmtree(self._dir, ignore_errors=True)  # the sockets' directory
        self._loop.remove_reader(self._zmq_fd)
        self._close_pidfd()
        self._zmq.destroy(linger=0)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            self._loop.remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None

    def join(self, timeout: float = 10.0) -> None:
        """Wait for the engine process to end; terminate it, then kill it, if it lingers."""
        process = self._process
        if process is None:
            return
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("the engine process did not stop; terminating it")
            process.terminate()
            try:
                process.wait(5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)

    @property
    def is_alive(self) -> bool:
        return (
            self._process is not None
            and self._process.poll() is None
            and self.error is None
            and not self._stopped
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def num_waiting(self) -> int:
        """Requests sent that have produced nothing yet (queued, or in their first prefill)."""
        return sum(1 for s in self._sinks.values() if not s.started)

    # -- requests (event loop) -------------------------------------------------------------
    async def add(
        self, requests: list[EngineRequest], prompt: str | None, queue: asyncio.Queue
    ) -> list[str]:
        """Send requests (their outputs go to `queue`, tagged with their place in the list)
        and wait until the engine took them: InvalidRequestError, OverloadedError or
        EngineFailure for the first it refused (the caller aborts the others). Returns the
        engine's warnings about them (what of a constraint it does not enforce), once each."""
        if not self.is_alive or self._draining:
            raise EngineFailure(
                "the server is shutting down" if self._draining else self._gone_message()
            )
        futures = []
        for index, req in enumerate(requests):
            if req.request_id in self._sinks:
                raise InvalidRequestError(f"request id {req.request_id!r} is already in use")
            self._sinks[req.request_id] = _Sink(queue, index)
            self.outputs.add(req.request_id, prompt, req.prompt_token_ids, req.sampling_params)
            future = self._loop.create_future()
            self._adds[req.request_id] = future
            futures.append(future)
            try:
                self._send(req)
            except EngineFailure:
                for sent in requests[: index + 1]:
                    self._adds.pop(sent.request_id, None)
                    self._refused(sent.request_id)
                raise
        results = await asyncio.gather(*futures)
        refused = [result for result in results if result.error is not None]
        for result in refused:
            self._refused(result.request_id)
        if refused:
            raise _as_exception(refused[0])
        return list(dict.fromkeys(w for result in results for w in result.warnings))

    def abort(self, request_id: str) -> None:
        if request_id in self._sinks and self.is_alive:
            with contextlib.suppress(EngineFailure):  # gone: nothing left to abort
                self._send(AbortRequests([request_id]))

    def abort_all(self) -> None:
        if self._sinks and self.is_alive:
            with contextlib.suppress(EngineFailure):
                self._send(AbortRequests(list(self._sinks)))

    async def call(self, name: str, *args):
        """Run a utility of the engine process (quill/engine/process.py) and return its value."""
        if self._process is None or self._process.poll() is not None:
            raise EngineFailure(self._gone_message())
        call_id = next(self._call_ids)
        future = self._calls[call_id] = self._loop.create_future()
        try:
            self._send(UtilityCall(call_id, name, list(args)))
        except EngineFailure:
            del self._calls[call_id]
            raise
        result: UtilityResult = await future
        if result.error is not None:
            raise EngineFailure(result.error)
        return result.value

    def _send(self, message) -> None:
        import zmq

        try:
            self._out.send(self._codec.encode(message), copy=False)
        except zmq.Again:
            raise EngineFailure(
                f"the engine took no message for {_SEND_TIMEOUT_MS / 1000:g} s: "
                + self._gone_message()
            ) from None
        # Sending can use up the edge the FD would signal for a message already waiting.
        self._loop.call_soon(self._drain_messages)

    def _refused(self, request_id: str) -> None:
        self._sinks.pop(request_id, None)
        self.outputs.discard(request_id)

    def _on_stop(self, request_id: str, stop: str, metrics: RequestMetrics) -> RequestMetrics:
        """A stop string ended a request here: the engine is told, the request ends now."""
        self._send(AbortRequests([request_id], "stop"))
        now = time.monotonic()
        return dataclasses.replace(
            metrics,
            e2e_latency=now - metrics.arrival_time,
            decode_time=None
            if metrics.time_to_first_token is None
            else now - metrics.arrival_time - metrics.time_to_first_token,
        )

    # -- what comes back (event loop) -------------------------------------------------------
    def _drain_messages(self) -> None:
        import zmq

        socket, codec, flags = self._in, self._read_codec, zmq.NOBLOCK
        while socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                data = socket.recv(flags, copy=False)
            except zmq.Again:
                return
            self._handle(codec.decode(data.buffer))

    def _handle(self, message) -> None:
        try:
            if isinstance(message, EngineOutputs):
                self._on_outputs(message)
            elif isinstance(message, AddResult):
                future = self._adds.pop(message.request_id, None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, UtilityResult):
                future = self._calls.pop(message.call_id, None)
                if future is not None and not future.done():
                    future.set_result(message)
            elif isinstance(message, EngineFailed):
                log.error("engine: %s", message.message)
                if message.fatal:
                    self.error = message.message
                self._fail_all(message.message)
        except Exception:  # noqa: BLE001 - one bad message must not stop the reader
            log.exception("handling the engine's %s failed", type(message).__name__)

    def _on_outputs(self, message: EngineOutputs) -> None:
        outputs = self.outputs.process(message.updates)
        for out in outputs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            sink.started = True
            if out.finished:
                del self._sinks[out.request_id]
            sink.queue.put_nowait((sink.index, out))
        if self.metrics is not None:
            self.metrics.on_step(outputs, message.stats, time.monotonic())

    def _deliver_failure(self, request_id: str, message: str) -> None:
        sink = self._sinks.pop(request_id, None)
        self.outputs.discard(request_id)
        if sink is not None:
            sink.queue.put_nowait((sink.index, EngineFailure(message)))

    def _fail_all(self, message: str) -> None:
        """Every request in flight gets the error; the engine is told to abort them."""
        ids = list(self._sinks)
        if ids and self.is_alive:
            self._send(AbortRequests(ids))
        for request_id in ids:
            self._deliver_failure(request_id, message)
        failure = AddResult("", None)
        for request_id, future in list(self._adds.items()):
            if not future.done():
                future.set_result(dataclasses.replace(failure, request_id=request_id))
        self._adds.clear()
        for future in self._calls.values():
            if not future.done():
                future.set_result(UtilityResult(-1, error=message))
        self._calls.clear()

    def _on_exit(self) -> None:
        """The engine process ended (its pidfd became readable)."""
        self._close_pidfd()
        self._process.wait(1)
        if self._stopped:
            return
        self.error = self._gone_message()
        log.error("%s", self.error)
        self._fail_all(self.error)
        if self.on_death is not None:
            self.on_death(self.error)

    def _gone_message(self) -> str:
        if self.error is not None:
            return self.error
        code = self._process.poll() if self._process is not None else None
        if code is None:
            return "the engine is not running"
        how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
        return f"the engine process died ({how})"


def _as_exception(result: AddResult) -> Exception:
    error = result.error
    if error.kind == "invalid":
        return InvalidRequestError(error.message, error.param)
    if error.kind == "overloaded":
        return OverloadedError(error.message, error.retry_after or 1.0)
    return EngineFailure(error.message)
