"""Processes quill starts never outlive the process that started them.

Every child (the engine process of `quill serve`, the instances of `--disaggregate` and
`--replicas`, tensor-parallel ranks) asks the kernel for a signal when its parent ends
(Linux's PR_SET_PDEATHSIG), however the parent ends: a signal it handles, SIGKILL, a crash.
The signal is SIGTERM where the child has something to end cleanly (an instance drains its
streams and stops its own engine) and SIGKILL where it has not. Each child also watches its
parent's pid as before, for platforms without the call.

The kernel sends the signal when the *thread* that started the child ends, so children are
started from a thread that lives as long as its process (the main thread, here).
"""

from __future__ import annotations

import ctypes
import os
import signal
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1
try:  # loaded here, not in a forked child (no dlopen between fork and exec)
    _libc = ctypes.CDLL(None, use_errno=True)
    _prctl = _libc.prctl
except (OSError, AttributeError):  # not Linux: the children's own watches remain
    _prctl = None


def die_with_parent(sig: int = signal.SIGTERM, parent_pid: int | None = None) -> bool:
    """Have `sig` sent to this process when its parent ends; if the parent (`parent_pid`)
    is already gone, send it now. Returns whether the kernel took the request."""
    if _prctl is None or _prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        return False
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), sig)  # the parent ended before the request was made
    return True


def child_setup(sig: int = signal.SIGTERM, cpus: set[int] | None = None) -> Callable[[], None]:
    """A `subprocess.Popen(preexec_fn=...)` that ties the child to this process (and pins it
    to `cpus`, if given). Call it in the parent: it records the parent's pid."""
    parent = os.getpid()

    def setup() -> None:
        die_with_parent(sig, parent)
        if cpus:
            os.sched_setaffinity(0, cpus)

    return setup
