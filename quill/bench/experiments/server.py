"""`quill serve` in a child process on a free port, for the load experiment.

The load experiment measures what a client of the real server sees, so the server runs as it
would for anyone: its own process, its own event loop, started from the command line.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time

SERVED_NAME = "experiments"


class ServerProcess:
    """Starts on entering (waits for the ready line), stops on leaving."""

    def __init__(self, flags: list[str], start_timeout: float = 300.0) -> None:
        self.flags = flags
        self.start_timeout = start_timeout
        self.url: str | None = None
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []  # the start-up output, for the error message

    def __enter__(self) -> ServerProcess:
        cmd = [sys.executable, "-m", "quill.cli", "serve", "--port", "0", "--no-access-log"]
        cmd += ["--served-model-name", SERVED_NAME, *self.flags]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + self.start_timeout
        ready = False
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())
            match = re.search(r"at (http://\S+) \(OpenAI", line)
            if match:
                self.url = match.group(1)
            if "ready" in line and self.url:
                ready = True
                break
            if time.monotonic() > deadline:
                break
        if not ready:
            self.stop()
            tail = "\n".join(self.lines[-20:])
            raise RuntimeError(f"`quill serve` did not start:\n{tail}")
        # Keep reading its output so that a full pipe never blocks the server.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
