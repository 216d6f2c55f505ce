"""The sides of the HTTP benchmark (bench_http.py), each a server started on its own port.

quill runs as `quill serve --port P` with nothing else, since its defaults are what is
measured; llama-server runs through benchmarks/peers/llama_cpp.py with its best settings, and
vLLM's CPU backend through benchmarks/peers/vllm_cpu.py (`vllm serve` of quill's converted
default model, bf16). Each side also says what to add to a request so that every token it
streams can be counted as it arrives, and how long its server may take to start.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.peers import llama_cpp, vllm_cpu
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


PEERS = ("llama", "vllm")  # what --peers of bench_http.py may name
VLLM_START_TIMEOUT_S = 400.0  # 90 to 190 s on 2 vCPUs, more the first time (torch.compile)


@dataclass
class Side:
    name: str
    make: Callable[[int], Any]  # port -> a server with start(timeout), stop(), url and cmd
    extra_body: dict  # what makes every token arrive in a chunk that says how many it holds
    start_timeout: float | None = None  # None: the server's own default


def make_sides(
    llama_types: list[str], threads: int, seq_tokens: int, peers=PEERS
) -> tuple[list[Side], dict[str, str]]:
    """quill, then llama-server on each GGUF type (peer "llama"), then vLLM (peer "vllm");
    `seq_tokens` (prompt plus output) sizes llama-server's context, which its 64 slots share
    (32768 tokens, 512 a slot, at least). A peer that is not built or installed is left out:
    the second value says which, and why (the PeerMissingError's message)."""
    sides = [Side("quill", QuillServe, {"logprobs": 0})]
    skipped: dict[str, str] = {}
    ctx = max(32768, 64 * -(-(seq_tokens + 16) // 256) * 256)
    for t in llama_types if "llama" in peers else []:
        try:
            model = llama_cpp.model_path(t)
            llama_cpp.binary("llama-server")
        except llama_cpp.PeerMissingError as e:
            skipped[f"llama-server-{t}"] = str(e)
            continue
        log = LOG_DIR / f"llama-server-{t}.log"

        def make(port, model=model, log=log):
            return llama_cpp.LlamaServer(model, port=port, threads=threads, ctx=ctx, log_path=log)

        sides.append(Side(f"llama-server-{t}", make, {"timings_per_token": True}))
    if "vllm" in peers:
        try:
            vllm_cpu.vllm_version()  # the venv, its `vllm` and the dist-info shim
            model = vllm_cpu.default_model_dir()
        except vllm_cpu.PeerMissingError as e:
            skipped["vllm"] = str(e)
        else:
            sides.append(
                Side(
                    "vllm",
                    functools.partial(make_vllm, model),
                    # Every chunk then carries the running usage.completion_tokens: exact even
                    # if vLLM merges several tokens into one chunk; no logprobs to compute.
                    {"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                    VLLM_START_TIMEOUT_S,
                )
            )
    return sides, skipped


def make_vllm(model: Path, port: int) -> vllm_cpu.VllmServer:
    """`vllm serve` of quill's converted default model under the name quill serves it by (bf16,
    --max-model-len 4096, 4 GiB of KV cache: vllm_cpu.VllmServer's defaults)."""
    return vllm_cpu.VllmServer(
        model,
        port=port,
        served_model_name=vllm_cpu.DEFAULT_MODEL_NAME,
        log_path=LOG_DIR / "vllm-serve.log",
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
