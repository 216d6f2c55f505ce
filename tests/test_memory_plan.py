"""Memory that follows the model (quill/model/memory_plan.py): a model too large for the
machine is refused before loading with the figures, the KV pool is sized from what is left
after the weights, and a context the pool cannot hold is clamped with a warning."""

from __future__ import annotations

import json
import logging

import pytest

from quill import LLM
from quill.contract.errors import ModelLoadError
from quill.model import memory_plan
from tests.conftest import write_tiny_config


def write_config(directory, model_dir, **shape) -> str:
    write_tiny_config(directory, model_dir)
    config = json.loads((directory / "config.json").read_text())
    config.update(shape)
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def test_a_model_too_large_is_refused_before_loading_with_the_figures(tmp_path, model_dir):
    # A 70B-shaped model in fp32 with random weights: 280 GB, refused before any is made.
    path = write_config(tmp_path, model_dir, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=128, vocab_size=128256)  # fmt: skip
    with pytest.raises(ModelLoadError, match=r"needs \d+\.\d+ GiB: weights .* GiB are available"):
        LLM(path, load_format="dummy", dtype="float32", tokenizer=str(model_dir))


def test_the_plan_counts_what_each_way_of_holding_weights_takes(model_dir):
    import torch

    cpu = torch.device("cpu")
    gguf = model_dir.parent  # not a GGUF: the config's count
    plan = memory_plan.plan_memory(gguf, "safetensors", 1000, 2, cpu, False, "auto")
    assert plan.parts == {"used as stored": 0, "repacked": 0, "floats": 2000, "int8 copies": 1062}
    plan = memory_plan.plan_memory(gguf, "safetensors", 1000, 4, cpu, False, "none")
    assert plan.parts["int8 copies"] == 0 and plan.weights == 4000
    left = plan.available - plan.weights - plan.working
    assert plan.kv_budget() == min(int(left * memory_plan.KV_SHARE), memory_plan.KV_CAP)


def test_a_context_the_pool_cannot_hold_is_clamped(tmp_path, model_dir, monkeypatch, caplog):
    caplog.set_level(logging.WARNING, logger="quill.model.factory")
    monkeypatch.setattr(memory_plan, "KV_CAP", 8 << 20)  # an 8 MiB pool by default
    # 2 layers x 2 KV heads x 64 dims x 2 (k, v) x 4 bytes: 2 KiB a token; 4096 positions.
    path = write_config(tmp_path, model_dir, max_position_embeddings=8192, head_dim=64,
                        num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    llm = LLM(path, load_format="dummy", dtype="float32", tokenizer=str(model_dir))
    assert llm.engine.max_model_len == 4096  # the pool: 8 MiB of 2 KiB tokens
    assert "max_model_len" in caplog.text and "8192" in caplog.text
    # Asked for by name, the context stays what was asked (the pool refuses what it cannot hold).
    asked = LLM(path, load_format="dummy", dtype="float32", tokenizer=str(model_dir),
                max_model_len=8192)  # fmt: skip
    assert asked.engine.max_model_len == 8192
