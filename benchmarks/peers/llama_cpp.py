"""llama.cpp as a benchmark peer: find what build_llama_cpp.sh built, and run it.

The benchmarks compare quill with llama.cpp on the same model. This module wraps the three
binaries the build script caches (llama-bench, llama-batched-bench, llama-server) behind small
functions that return plain dicts, so a benchmark needs nothing beyond the standard library to
drive the peer. Build first with `bash benchmarks/peers/build_llama_cpp.sh`.
"""

from __future__ import annotations

import functools
import json
import os
import re
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

from benchmarks.peers.process import ServerProcess

BUILD_SCRIPT = "benchmarks/peers/build_llama_cpp.sh"
BINARIES = ("llama-server", "llama-bench", "llama-batched-bench")
MODEL_TYPES = ("f32", "bf16", "q8_0", "q4_1")


class PeerMissingError(FileNotFoundError):
    """A binary or model of the peer is not built yet."""


def peers_dir() -> Path:
    """Where the build script caches everything: ${QUILL_CACHE:-~/.cache/quill}/peers."""
    return Path(os.environ.get("QUILL_CACHE", Path.home() / ".cache" / "quill")) / "peers"


def _missing(what: Path) -> PeerMissingError:
    return PeerMissingError(f"{what} not found: build llama.cpp first with `bash {BUILD_SCRIPT}`")


def binary(name: str) -> Path:
    """Path of one of BINARIES."""
    path = peers_dir() / "bin" / name
    if not os.access(path, os.X_OK):
        raise _missing(path)
    return path


def model_path(gguf_type: str) -> Path:
    """Path of the default model in GGUF, one of MODEL_TYPES (f32, bf16, q8_0, q4_1)."""
    path = peers_dir() / "models" / f"smollm2-135m-{gguf_type}.gguf"
    if not path.is_file():
        raise _missing(path)
    return path


def build_info() -> dict:
    """What the build script recorded (llama-cpp-python version, llama.cpp build, flags)."""
    info: dict = {}
    path = peers_dir() / "BUILD_INFO"
    if not path.is_file():
        raise _missing(path)
    for line in path.read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep:
            info[key.strip()] = value.strip()
    return info


@functools.cache
def help_text(name: str) -> str:
    """The --help output of a binary, to check which flags this build accepts."""
    proc = subprocess.run(
        [str(binary(name)), "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    return proc.stdout + proc.stderr


def _run(cmd: list[str], timeout: float) -> str:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    return proc.stdout + "\n" + proc.stderr


def _csv(values) -> str:
    return ",".join(str(v) for v in values)


# --- llama-bench ---------------------------------------------------------------------------------


def llama_bench(
    model: Path | str,
    *,
    n_prompt=(0,),
    n_gen=(0,),
    threads: int = 2,
    repetitions: int = 3,
    flash_attn: bool = True,
    extra: tuple[str, ...] = (),
    timeout: float = 1800,
) -> list[dict]:
    """Runs llama-bench once (`-o json`) and returns its test records as they are."""
    cmd = [
        str(binary("llama-bench")),
        "-m",
        str(model),
        "-p",
        _csv(n_prompt),
        "-n",
        _csv(n_gen),
        "-t",
        str(threads),
        "-fa",
        "1" if flash_attn else "0",
        "-r",
        str(repetitions),
        "-o",
        "json",
        *extra,
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-20:])
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{tail}")
    return json.loads(proc.stdout)


def _summary(record: dict, tokens: int) -> dict:
    samples = record.get("samples_ns") or [record["avg_ns"]]
    best_s = min(samples) / 1e9
    return {
        "seconds": best_s,
        "avg_seconds": record["avg_ns"] / 1e9,
        "tokens_per_s": tokens / best_s,
        "avg_tokens_per_s": record["avg_ts"],
        "stddev_tokens_per_s": record.get("stddev_ts"),
        "samples": len(samples),
    }


def bench_decode(model: Path | str, n_gen: int = 128, **kw) -> dict:
    """Batch-1 decode of n_gen tokens (`-n N -p 0`): best-of-repetitions tokens/s and step ms."""
    (record,) = [r for r in llama_bench(model, n_prompt=(0,), n_gen=(n_gen,), **kw) if r["n_gen"]]
    out = _summary(record, n_gen)
    out["step_ms"] = 1000 * out["seconds"] / n_gen
    out["build_commit"] = record.get("build_commit")
    return out


def bench_prompt(model: Path | str, n_prompt=(512,), **kw) -> dict[int, dict]:
    """Prompt processing (`-p N -n 0`) for each length: seconds (time to first token) and tok/s."""
    records = llama_bench(model, n_prompt=tuple(n_prompt), n_gen=(0,), **kw)
    return {r["n_prompt"]: _summary(r, r["n_prompt"]) for r in records if r["n_prompt"]}


# --- llama-batched-bench -----------------------------------------------------------------------

_TABLE_ROW = re.compile(r"^\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 9 + r"\s*$")


def batched_bench(
    model: Path | str,
    *,
    npp: int,
    ntg: int,
    npl=(1,),
    threads: int = 2,
    ctx: int | None = None,
    batch: int = 2048,
    ubatch: int = 512,
    flash_attn: bool = True,
    extra: tuple[str, ...] = (),
    timeout: float = 3600,
) -> dict[int, dict]:
    """Runs llama-batched-bench: npl sequences each with an npp-token prompt decode ntg tokens.

    Returns, per number of sequences, the decode rate (output tokens/s over the decode phase),
    the decode step time in ms (one step emits one token for every sequence) and the prompt
    time. ctx defaults to what the largest npl needs; rows that don't fit are skipped by
    llama.cpp itself, so it is never smaller.
    """
    npl = tuple(npl)
    need = max(npl) * (npp + ntg)
    ctx = max(ctx or 0, -(-need // 256) * 256)
    cmd = [
        str(binary("llama-batched-bench")),
        "-m",
        str(model),
        "-t",
        str(threads),
        "-c",
        str(ctx),
        "-b",
        str(batch),
        "-ub",
        str(ubatch),
        "-npp",
        str(npp),
        "-ntg",
        str(ntg),
        "-npl",
        _csv(npl),
        "-fa",
        "on" if flash_attn else "off",
        *extra,
    ]
    jsonl = "--output-format" in help_text("llama-batched-bench")
    if jsonl:
        cmd += ["--output-format", "jsonl"]
    text = _run(cmd, timeout)
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if jsonl and line.startswith("{"):
            rows.append(json.loads(line))
        elif not jsonl and (m := _TABLE_ROW.match(line)):
            pp, tg, pl, n_kv = (int(m.group(i)) for i in range(1, 5))
            t_pp, s_pp, t_tg, s_tg, t, s = (float(m.group(i)) for i in range(5, 11))
            rows.append(
                {"pp": pp, "tg": tg, "pl": pl, "n_kv": n_kv, "t_pp": t_pp, "speed_pp": s_pp}
                | {"t_tg": t_tg, "speed_tg": s_tg, "t": t, "speed": s}
            )
    results = {}
    for r in rows:
        results[r["pl"]] = {
            "decode_tokens_per_s": r["speed_tg"],
            "step_ms": 1000 * r["t_tg"] / r["tg"],
            "prompt_s": r["t_pp"],
            "tokens_per_s": r["pl"] * r["tg"] / r["t"],  # prompt included, as quill's decode row
            "n_kv": r["n_kv"],
        }
    if missing := [n for n in npl if n not in results]:
        raise RuntimeError(f"llama-batched-bench gave no result for npl={missing}:\n{text[-2000:]}")
    return results


# --- llama-server ------------------------------------------------------------------------------


class LlamaServer(ServerProcess):
    """A llama-server process on 127.0.0.1 (continuous batching, flash attention).

    Use as a context manager, or call start() and stop().
    """

    def __init__(
        self,
        model: Path | str,
        *,
        port: int = 8091,
        threads: int = 2,
        ctx: int = 32768,
        parallel: int = 64,
        extra: tuple[str, ...] = (),
        log_path: Path | str | None = None,
    ):
        self.model = Path(model)
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.cmd = [
            str(binary("llama-server")),
            "-m",
            str(self.model),
            "-t",
            str(threads),
            "-c",
            str(ctx),
            "-np",
            str(parallel),
            "-cb",
            "-fa",
            "on",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *extra,
        ]
        self.log_path = Path(log_path) if log_path else peers_dir() / f"llama-server-{port}.log"

    name = "llama-server"

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=2) as resp:
                return resp.status == 200 and json.loads(resp.read()).get("status") == "ok"
        except (urllib.error.URLError, OSError, ValueError):
            return False


def start_server(model: Path | str, **kw) -> LlamaServer:
    """Starts llama-server and returns once /health says ok; stop it with .stop()."""
    return LlamaServer(model, **kw).start()
