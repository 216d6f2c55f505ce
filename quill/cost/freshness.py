"""Whether a saved calibration still describes this process: its machine, build and weights.

`quill cost calibrate` fits its coefficients on one CPU, one build of the native kernels, one
torch and one set of weight formats. Priced with another's coefficients a step is off by what
changed (a rebuilt kernel or another weight format can move a step's time 2x, and the queue in
front of a request multiplies that error). So every calibration records its key, and each use
compares it with the key of the process at hand:

- `native_library`: the native library this process loads (`avx512-e8efc6a6c7bd`: its
  instruction set and source hash), or `pytorch` without one;
- `cpu_model`, and `cpu_flags_hash` (of the sorted feature flags);
- `torch`: its version;
- `weight_formats`: the formats the model's linear layers are computed from (`float32`,
  `int8`, `q4_K`, ...), sorted.

A calibration whose key differs, or that records none (made before keys), is stale. What then
is the user's choice (`quill serve --calibration`, or QUILL_CALIBRATION): `refit` (the
default: `quill cost calibrate --quick` on the model at hand, into a file of its own, its
progress shown), `refuse` (stop, naming the command to run), or `as-is` (use it, warned).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from quill.lifetime import child_setup

log = logging.getLogger(__name__)

KEY_FIELDS = ("native_library", "cpu_model", "cpu_flags_hash", "torch", "weight_formats")
POLICIES = ("refit", "refuse", "as-is")


def default_policy() -> str:
    policy = os.environ.get("QUILL_CALIBRATION", "refit")
    if policy not in POLICIES:
        raise ValueError(f"QUILL_CALIBRATION={policy!r}: one of {', '.join(POLICIES)}")
    return policy


def native_library_key() -> str:
    """The native library this process loads (or would: the same choice), or `pytorch`."""
    from quill.ops import library

    if os.environ.get("QUILL_NATIVE", "1") == "0":
        return "pytorch"
    isa = library._choose_isa()
    if isa is None or not library.library_path(isa).is_file():
        return "pytorch"
    return f"{isa}-{library.source_hash(isa)}"


def flags_hash(flags: list[str]) -> str:
    return hashlib.sha256(" ".join(sorted(flags)).encode()).hexdigest()[:12]


def weight_formats(model) -> list[str]:
    """The formats a model's linear layers compute from: stored blocks by their GGUF type,
    quantized copies by method, float weights by dtype."""
    from torch import nn

    from quill.model.quant import QuantizedLinear
    from quill.model.stored import StoredLinear

    found = set()
    for module in model.modules():
        if isinstance(module, StoredLinear):
            found.update(s.type_name for s in module.segments)
            if module.float_weight is not None:
                found.add(str(module.float_weight.dtype).removeprefix("torch."))
        elif isinstance(module, QuantizedLinear):
            found.add(module.method)
            if module.float_weight is not None:  # auto: the float copy for larger steps
                found.add(str(module.float_weight.dtype).removeprefix("torch."))
        elif isinstance(module, nn.Linear) and module.weight.is_floating_point():
            found.add(str(module.weight.dtype).removeprefix("torch."))
    return sorted(found)


def current_key(formats: list[str]) -> dict:
    import torch

    from quill.cost.calibrate import cpu_info

    cpu = cpu_info()
    return {
        "native_library": native_library_key(),
        "cpu_model": cpu["cpu_model"],
        "cpu_flags_hash": flags_hash(cpu["cpu_flags"]),
        "torch": torch.__version__,
        "weight_formats": sorted(formats),
    }


def key_name(key: dict) -> str:
    """A short name of a key, for a calibration file of its own."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:8]


def stale_reasons(calibration: dict, key: dict) -> list[str]:
    """Why a calibration does not describe a process of `key` (none: it does)."""
    recorded = calibration.get("key")
    if not isinstance(recorded, dict):
        return ["it records no key (made before calibrations were keyed)"]
    reasons = []
    for field in KEY_FIELDS:
        then, now = recorded.get(field), key.get(field)
        if then != now:
            if field == "cpu_flags_hash":
                reasons.append("the CPU's feature flags differ")
            else:
                reasons.append(f"{field}: calibrated with {then}, now {now}")
    return reasons


def find(dtype: str, key: dict, directory: Path | None = None) -> tuple[Path | None, list[str]]:
    """This machine's calibration for `dtype`: the newest whose key is `key` (no reasons), else
    the newest for `dtype` with why it is stale; (None, []) when there is none."""
    from quill.cost.live import saved_calibrations

    fresh, stale = [], []
    for mtime, path, calibration in saved_calibrations(dtype, directory):
        reasons = stale_reasons(calibration, key)
        (stale if reasons else fresh).append((mtime, path, reasons))
    if fresh:
        return max(fresh)[1], []
    if stale:
        _, path, reasons = max(stale)
        return path, reasons
    return None, []


def refit_command(model: str, dtype: str, quantization: str, out: Path, extra=()) -> list[str]:
    return [sys.executable, "-m", "quill.cli", "cost", "calibrate", "--quick",
            "--model", str(model), "--dtype", dtype, "--quantization", quantization,
            "--out", str(out), *extra]  # fmt: skip


def resolve_stale(
    path: Path,
    reasons: list[str],
    policy: str,
    model: str,
    dtype: str,
    quantization: str,
    key: dict,
    extra: tuple[str, ...] = (),
) -> Path:
    """The calibration to use when the one found is stale: refitted (a new file beside it),
    refused (ValueError naming the command), or that one (warned)."""
    from quill.cost.calibrate import default_out

    out = default_out(dtype, key)
    command = refit_command(model, dtype, quantization, out, extra)
    shown = "quill " + shlex.join(command[3:])
    why = "; ".join(reasons)
    if policy == "as-is":
        log.warning("cost: the calibration %s is stale (%s); used as it is (--calibration "
                    "as-is). Refit it: %s", path, why, shown)  # fmt: skip
        return path
    if policy == "refuse":
        raise ValueError(
            f"the calibration {path} is stale ({why}); refit it with `{shown}`, or start with "
            "--calibration as-is (or refit)"
        )
    log.info("cost: the calibration %s is stale (%s); refitting it once, into %s (a quick "
             "sweep of engine steps, about a minute on a small model)", path, why, out)  # fmt: skip
    # Its progress bars on this console; it ends with this process, however that ends.
    done = subprocess.run(command, preexec_fn=child_setup(signal.SIGTERM))
    if done.returncode != 0:
        raise ValueError(f"refitting the calibration failed ({shown})")
    return out
