"""Which native library this CPU runs, where it is built, and loading it once.

There is one library per instruction set (`avx2`, `avx512`), compiled from the same sources in
`csrc/` with different flags: code for an instruction set the CPU lacks must never be loaded
(it would die on the first such instruction), and two libraries cannot both be loaded (they
register the same `quill::` ops). The choice is made here from the CPU's flags, at import,
never by compiling: `make setup` builds the libraries (quill/ops/build.py) into
`$QUILL_CACHE/ops/<torch version>-<isa>-<source hash>/`, and a process that finds none logs
one line and runs the PyTorch reference path. `QUILL_NATIVE=0` forces that path;
`QUILL_NATIVE_ISA=avx2` picks a library the CPU can run other than the best one (tests use it
to check the AVX2 library on an AVX-512 machine).
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from quill.config import cache_dir

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = (
    "ops.cpp",
    "attention.cpp",
    "write_kv.cpp",
    "probe.cpp",
    "qlinear.cpp",
    "dense.cpp",
    "fused.cpp",
    "layer.cpp",
    "argmax.cpp",
    "logprobs.cpp",
    "kquant.cpp",
    "kquant_tiles.cpp",
    "kquant_dequant.cpp",
)
HEADERS = ("ops.h", "vec.h", "gemm.h", "cache_layout.h", "kquant.h", "kquant_tiles.h")

_AVX2 = ("-mavx2", "-mfma", "-mf16c")
_AVX512 = (
    *_AVX2,
    "-mavx512f",
    "-mavx512bw",
    "-mavx512vl",
    "-mavx512dq",
    "-mavx512vnni",
    "-mavx512bf16",
)
# Compiler flags of each library, and the /proc/cpuinfo flags a CPU needs to run it.
ISA_FLAGS: dict[str, tuple[str, ...]] = {"avx2": _AVX2, "avx512": (*_AVX512, "-DQUILL_AVX512")}
ISA_CPU_FLAGS: dict[str, frozenset[str]] = {
    "avx2": frozenset({"avx2", "fma", "f16c"}),
    "avx512": frozenset(
        {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"}
        | {"avx512_vnni", "avx512_bf16"}
    ),
}
ISAS_BEST_FIRST = ("avx512", "avx2")
COMMON_FLAGS = ("-O3", "-std=c++17", "-fopenmp", "-fno-math-errno", "-DNDEBUG")


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux reports them (empty where /proc/cpuinfo is missing)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def runnable_isas(flags: frozenset[str] | None = None) -> list[str]:
    """The libraries this CPU can run, best first."""
    flags = cpu_flags() if flags is None else flags
    return [isa for isa in ISAS_BEST_FIRST if ISA_CPU_FLAGS[isa] <= flags]


def source_hash(isa: str) -> str:
    """Names a build: the sources, the headers and this library's flags."""
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode())
        digest.update((SOURCE_DIR / name).read_bytes())
    digest.update(" ".join((*COMMON_FLAGS, *ISA_FLAGS[isa])).encode())
    return digest.hexdigest()[:12]


def library_path(isa: str) -> Path:
    """Where `make setup` puts (and a process looks for) this CPU's build of one library."""
    version = torch.__version__.replace("+", "_")
    folder = cache_dir() / "ops" / f"{version}-{isa}-{source_hash(isa)}"
    return folder / f"quill_{isa}.so"


@dataclass(frozen=True)
class NativeLibrary:
    isa: str
    path: Path


def _choose_isa() -> str | None:
    runnable = runnable_isas()
    wanted = os.environ.get("QUILL_NATIVE_ISA")
    if wanted:
        if wanted not in runnable:
            log.warning(
                "QUILL_NATIVE_ISA=%s: this CPU runs %s; using the PyTorch path",
                wanted,
                ", ".join(runnable) or "neither native library",
            )
            return None
        return wanted
    return runnable[0] if runnable else None


@torch._dynamo.assume_constant_result
def available() -> bool:
    """Whether the native library is loaded: what a model's forward asks, a constant to
    torch.compile (tracing `load` itself would trace its logging: a graph break each time)."""
    return load() is not None


@cache
def load() -> NativeLibrary | None:
    """Loads the best native library this CPU runs, once per process; None: PyTorch path."""
    if os.environ.get("QUILL_NATIVE", "1") == "0":
        log.info("native kernels: off (QUILL_NATIVE=0); attention runs the PyTorch path")
        return None
    isa = _choose_isa()
    if isa is None:
        if not runnable_isas():
            log.info("native kernels: this CPU has neither AVX2+FMA+F16C nor AVX-512; PyTorch path")
        return None
    if not SOURCE_DIR.is_dir():
        log.warning("native kernels: no sources at %s; attention runs the PyTorch path", SOURCE_DIR)
        return None
    path = library_path(isa)
    if not path.is_file():
        log.warning(
            "native kernels: the %s library is not built for these sources (%s missing; "
            "`make setup` builds it); attention runs the PyTorch path",
            isa,
            path,
        )
        return None
    try:
        torch.ops.load_library(str(path))
    except (OSError, RuntimeError) as e:
        log.warning(
            "native kernels: loading %s failed (%s); attention runs the PyTorch path", path, e
        )
        return None
    from quill.ops import fake  # noqa: F401  (registers the fake kernels for torch.compile)

    log.info("native kernels: %s library (%s)", isa, path)
    return NativeLibrary(isa, path)
