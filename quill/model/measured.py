"""Start-up measurements kept per machine.

quill chooses some paths by timing them here at load (which product serves which step sizes:
quill/model/stored_timing.py). The timings depend on the machine, the native library, the threads,
torch, and the shapes and types timed, not on the weights' values; so they are kept under
`$QUILL_CACHE/measured/`, keyed by all of those, and a second start reads them instead of
timing again (seconds, for a 1B-8B model). Delete the folder to measure again.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from quill.config import cache_dir

log = logging.getLogger(__name__)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a timing made here depends on, besides what was timed."""
    from quill.ops import library

    native = library.load()
    return {
        "cpu": _cpu_name(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "library": None if native is None else f"{native.isa}-{native.path.parent.name}",
    }


def remembered(kind: str, what: dict, measure: Callable[[], Any]) -> Any:
    """`measure()`'s value (JSON) for `what` on this machine: from an earlier start if one
    measured it, else measured now and kept."""
    key = json.dumps({"kind": kind, "what": what, "machine": machine()}, sort_keys=True)
    path = cache_dir() / "measured" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    try:
        kept = json.loads(path.read_text())
        if kept.get("key") == key:
            log.info("%s: measured at an earlier start on this machine (%s)", kind, path)
            return kept["value"]
    except (OSError, ValueError):
        pass
    value = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        partial.write_text(json.dumps({"key": key, "value": value}))
        partial.replace(path)
    except OSError as err:  # a read-only cache: measured again next time
        log.warning("%s: could not keep the measurement in %s: %s", kind, path, err)
    return value
