"""The two sides of the HTTP benchmark (bench_http.py), each a server started on its own port.

quill runs as `quill serve --port P` with nothing else, since its defaults are what is
measured; llama-server runs through benchmarks/peers/llama_cpp.py with its best settings. Each
side also says what to add to a request so that every token arrives as a chunk one can count.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers import llama_cpp
from benchmarks.peers.process import ServerProcess

LOG_DIR = Path(tempfile.gettempdir()) / "quill-bench-http"


class QuillServe(ServerProcess):
    """`quill serve --port P` and nothing more: its defaults are what is measured."""

    name = "quill serve"

    def __init__(self, port: int):
        exe = Path(sys.executable).with_name("quill")
        head = [str(exe)] if exe.exists() else [sys.executable, "-m", "quill.cli"]
        self.cmd = [*head, "serve", "--port", str(port)]
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = LOG_DIR / "quill-serve.log"
        self.env = {k: v for k, v in os.environ.items() if k != "QUILL_API_KEY"}

    def start(self, timeout: float = 300) -> QuillServe:
        return super().start(timeout)


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
