"""A benchmarked server as a child process: start it, wait until it is healthy, stop it.

Both HTTP sides (quill serve and llama-server) run this way; only their command line and what
counts as healthy differ. Standard library only, like the rest of `benchmarks/peers`.
"""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path


class ServerProcess:
    """Subclasses set `name`, `cmd`, `url`, `log_path` (and `env`, None: inherit) in __init__."""

    name = "server"
    cmd: list[str]
    url: str
    log_path: Path
    env: dict[str, str] | None = None
    proc: subprocess.Popen | None = None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def start(self, timeout: float = 120) -> ServerProcess:
        if self.proc is not None:
            return self
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # closed in stop()
        self.proc = subprocess.Popen(
            self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=self.env
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                tail = "\n".join(self.log_path.read_text().splitlines()[-20:])
                raise RuntimeError(f"{self.name} exited during start-up:\n{tail}")
            if self.healthy():
                return self
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"{self.name} not healthy after {timeout} s (log: {self.log_path})")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        self.proc = None

    def __enter__(self) -> ServerProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
