"""uvicorn's server as quill's servers run it: a clean exit after a signal, the first signal
draining what is in flight (a second forces the exit), and a ready line once bound."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn


class CleanExitServer(uvicorn.Server):
    """uvicorn's server, returning from `run` after a signal instead of dying of it.

    uvicorn re-raises a SIGTERM or SIGINT once it has shut down, so its process dies of the
    signal before the code after `run` (which stops the processes it started) can run. quill
    has shut down cleanly by then, so it exits 0 instead.
    """

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list):
                captured.clear()


class DrainingServer(CleanExitServer):
    """Drains (`drain`: end the streams in flight, refuse new requests) on the first signal,
    then lets uvicorn shut down; prints `ready_lines` and "quill: ready" once bound."""

    def __init__(self, config: uvicorn.Config, announce: bool = True) -> None:
        super().__init__(config)
        self.announce = announce
        self.loop: asyncio.AbstractEventLoop | None = None
        self.base_url: str | None = None
        self.exit_code = 0

    def drain(self) -> None:
        raise NotImplementedError

    def ready_lines(self) -> list[str]:
        return []

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if not self.started or not self.servers:
            return
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        shown = f"[{host}]" if ":" in host else host
        self.base_url = f"http://{shown}:{port}"
        if self.announce:
            for line in self.ready_lines():
                print(line)
            print("quill: ready (Ctrl-C to stop)", flush=True)

    def request_shutdown(self) -> None:
        """Thread-safe: drain, then let uvicorn shut down."""
        if self.loop is not None and not self.loop.is_closed():
            with contextlib.suppress(RuntimeError):
                self.loop.call_soon_threadsafe(self.drain)
        self.should_exit = True

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: uvicorn forces the exit
        else:
            self.request_shutdown()
