"""Builds the native libraries once, at set-up: `python -m quill.ops.build` (run by `make setup`).

Every library this CPU can run is compiled (so an AVX-512 machine also has the AVX2 one, which
its tests check) with the machine's g++ and ninja through `torch.utils.cpp_extension`, into the
folder `quill.ops.library.library_path` names after torch's version, the instruction set and a
hash of the sources and flags. A library already there is not rebuilt, so a second set-up
compiles nothing. Each library builds in a child process, because building one also loads it
and two cannot share a process. A failed build is reported and set-up goes on: quill then runs
its PyTorch path and says so at start-up.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from quill.ops.library import (
    COMMON_FLAGS,
    ISA_FLAGS,
    SOURCE_DIR,
    SOURCES,
    library_path,
    runnable_isas,
)

# Libraries kept per torch and instruction set, this build's included.
KEPT_BUILDS = 4


def _compile(isa: str, verbose: bool) -> Path:
    """Compiles one library in this process (which then has it loaded)."""
    from torch.utils.cpp_extension import load

    target = library_path(isa)
    work = target.parent / "build"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    # The venv's own ninja (a pip package) when the shell's PATH lacks it.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    load(
        name=f"quill_{isa}",
        sources=[str(SOURCE_DIR / s) for s in SOURCES],
        extra_cflags=[*COMMON_FLAGS, *ISA_FLAGS[isa]],
        extra_ldflags=["-fopenmp"],
        build_directory=str(work),
        is_python_module=False,
        verbose=verbose,
    )
    os.replace(work / f"quill_{isa}.so", target)
    shutil.rmtree(work, ignore_errors=True)
    # Builds of earlier sources for this torch and instruction set are kept a while, the newest
    # few: another checkout on this machine (a worktree, an older version) may still load one.
    prefix = target.parent.name.rsplit("-", 1)[0] + "-"
    others = [p for p in target.parent.parent.glob(prefix + "*") if p != target.parent]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    for old in others[KEPT_BUILDS - 1 :]:
        shutil.rmtree(old, ignore_errors=True)
    return target


def build(isas: list[str], force: bool = False, verbose: bool = False) -> dict[str, bool]:
    """Builds what is missing; returns, per library, whether it is there now."""
    ready = {}
    for isa in isas:
        target = library_path(isa)
        if target.is_file() and not force:
            print(f"native kernels: {isa} up to date ({target})", flush=True)
            ready[isa] = True
            continue
        flags = " ".join(ISA_FLAGS[isa])
        print(
            f"native kernels: building {isa} ({', '.join(SOURCES)}; {flags}) -> {target.parent}",
            flush=True,
        )
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "quill.ops.build", "--compile-one", isa]
        if verbose:
            cmd.append("--verbose")
        proc = subprocess.run(cmd, capture_output=not verbose, text=True)
        seconds = time.perf_counter() - start
        if proc.returncode == 0 and target.is_file():
            print(f"native kernels: built {isa} in {seconds:.0f} s", flush=True)
            ready[isa] = True
            continue
        ready[isa] = False
        output = ((proc.stdout or "") + (proc.stderr or "")).strip().splitlines()
        print(
            f"native kernels: building {isa} FAILED after {seconds:.0f} s; quill will run its "
            "PyTorch path. The compiler said:",
            flush=True,
        )
        for line in output[-25:]:
            print(f"    {line}", flush=True)
    return ready


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--isa", action="append", help="build only this library (avx2, avx512)")
    parser.add_argument("--force", action="store_true", help="rebuild even if up to date")
    parser.add_argument("--verbose", action="store_true", help="show the compiler's commands")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a build fails")
    parser.add_argument("--compile-one", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.compile_one:
        _compile(args.compile_one, args.verbose)
        return 0
    isas = args.isa or runnable_isas()
    if not isas:
        print("native kernels: this CPU runs neither library (needs AVX2, FMA and F16C)")
        return 0
    ready = build(isas, args.force, args.verbose)
    return 1 if args.strict and not all(ready.values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
