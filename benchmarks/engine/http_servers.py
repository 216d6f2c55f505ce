"""The two sides of the HTTP benchmark (bench_http.py), each a server started on its own port.

quill runs as `quill serve --port P` with nothing else, since its defaults are what is
measured; llama-server runs through benchmarks/peers/llama_cpp.py with its best settings. Each
side also says what to add to a request so that every token arrives as a chunk one can count.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.peers import llama_cpp

LOG_DIR = Path(tempfile.gettempdir()) / "quill-bench-http"


class QuillServe:
    """`quill serve --port P` and nothing more: its defaults are what is measured."""

    def __init__(self, port: int):
        exe = Path(sys.executable).with_name("quill")
        head = [str(exe)] if exe.exists() else [sys.executable, "-m", "quill.cli"]
        self.cmd = [*head, "serve", "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = LOG_DIR / "quill-serve.log"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 300) -> QuillServe:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")  # closed in stop()
        env = {k: v for k, v in os.environ.items() if k != "QUILL_API_KEY"}
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                tail = "\n".join(self.log_path.read_text().splitlines()[-20:])
                raise RuntimeError(f"quill serve exited during start-up:\n{tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise TimeoutError(f"quill serve not healthy after {timeout} s (log: {self.log_path})")

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


@dataclass
class Side:
    name: str
    make: Callable[[int], Any]  # port -> a server with start(), stop(), url and cmd
    extra_body: dict  # what makes every token arrive as a countable chunk


def make_sides(llama_types: list[str], threads: int, seq_tokens: int) -> list[Side]:
    """quill, then llama-server on each GGUF type; `seq_tokens` (prompt plus output) sizes
    llama-server's context, which its 64 slots share (32768 tokens, 512 a slot, at least)."""
    sides = [Side("quill", QuillServe, {"logprobs": 0})]
    ctx = max(32768, 64 * -(-(seq_tokens + 16) // 256) * 256)
    for t in llama_types:
        model = llama_cpp.model_path(t)
        log = LOG_DIR / f"llama-server-{t}.log"

        def make(port, model=model, log=log):
            return llama_cpp.LlamaServer(model, port=port, threads=threads, ctx=ctx, log_path=log)

        sides.append(Side(f"llama-server-{t}", make, {"timings_per_token": True}))
    return sides


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
