"""How the API process and the engine process share this machine's cores.

On a small machine the two compete: the engine's compute threads want every core for the
whole step, the API process wakes for every token of every stream. vLLM gives its API process
a core of its own on 2 vCPUs; on quill's 2-vCPU machines sharing measured faster at every
stream count (docs/benchmarks.md, issue 18), so `auto` shares.
"""

from __future__ import annotations

import os

# What measured faster on 2 vCPUs (docs/benchmarks.md, issue 18): see split_cores.
_AUTO_API_CORE = "shared"


def split_cores(api_core: str) -> tuple[set[int] | None, set[int] | None]:
    """(the API process's CPUs, the engine process's), or (None, None) when they share all.

    "own" gives the API process the first CPU this process may use and the engine the rest;
    it needs at least two. "auto" is what the HTTP benchmark measured faster on this project's
    2-vCPU machines.
    """
    if api_core not in ("auto", "shared", "own"):
        raise ValueError(f"unknown api_core {api_core!r} (auto | shared | own)")
    if api_core == "auto":
        api_core = _AUTO_API_CORE
    allowed = sorted(os.sched_getaffinity(0))
    if api_core == "shared" or len(allowed) < 2:
        return None, None
    return {allowed[0]}, set(allowed[1:])
