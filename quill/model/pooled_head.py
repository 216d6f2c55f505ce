"""The Dense modules of a sentence-transformers pipeline: projections of the pooled vector
(EmbeddingGemma: 768 -> 3072 -> 768, no bias, no activation), run after pooling and before
normalizing, as sentence-transformers runs them.

`modules.json` lists them in order; each has its folder with `config.json` (in_features,
out_features, bias, activation_function by its torch class name) and `model.safetensors`
(`linear.weight`, `linear.bias`). Kept in fp32 (a few million weights, once a prompt). Only
an encoder's pooling runs them (quill/model/runner.py): its prompt is pooled whole in one
step, while a causal model's mean is summed chunk by chunk in the engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from quill.contract.errors import ModelLoadError


def read_pooled_head(source: Path) -> nn.Sequential | None:
    """The model's Dense modules in order (None: it has none)."""
    modules_file = source / "modules.json" if source.is_dir() else None
    if modules_file is None or not modules_file.is_file():
        return None
    layers: list[nn.Module] = []
    for module in json.loads(modules_file.read_text()):
        if module.get("type", "").rsplit(".", 1)[-1] == "Dense":
            layers += _dense(source / module.get("path", ""))
    return nn.Sequential(*layers).eval() if layers else None


def _dense(folder: Path) -> list[nn.Module]:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"sentence-transformers Dense module {folder}: {e}") from e
    if (
        config.get("use_residual")
        or config.get("module_input_name", "sentence_embedding") != "sentence_embedding"
    ):
        raise ModelLoadError(f"{folder}: a Dense module with a residual or another input is "
                             "not supported")  # fmt: skip
    linear = nn.Linear(config["in_features"], config["out_features"],
                       bias=config.get("bias", True), dtype=torch.float32)  # fmt: skip
    weights_file = folder / "model.safetensors"
    if not weights_file.is_file():
        raise ModelLoadError(f"{folder}: no model.safetensors (only safetensors are read)")
    weights = load_file(str(weights_file))
    with torch.no_grad():
        linear.weight.copy_(weights["linear.weight"])
        if linear.bias is not None:
            linear.bias.copy_(weights["linear.bias"])
    return [linear, _activation(config.get("activation_function"), folder)]


def _activation(name: str | None, folder: Path) -> nn.Module:
    """sentence-transformers' default is Tanh; a saved one is a torch.nn class's path."""
    if name is None:
        return nn.Tanh()
    cls = getattr(nn, name.rsplit(".", 1)[-1], None) if name.startswith("torch.nn.") else None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelLoadError(f"{folder}: activation_function {name!r} is not supported")
    return cls()
