"""Loading paths: GGUF, tiny random Llama-3 / Qwen2 / Mistral checkpoints, shards, dummy weights."""

from __future__ import annotations

import pytest
import torch

from quill import LLM, SamplingParams
from quill.model.config import ModelConfig
from quill.model.llama import rope_inv_freq
from tests.conftest import write_tiny_config


def test_gguf_weights_match_transformers_gguf_loader():
    """Our GGUF reading (dequantize + undoing llama.cpp's q/k row order) against transformers'."""
    from transformers import AutoModelForCausalLM

    from quill.model import gguf_loader
    from quill.model.default_model import default_gguf_path

    path = default_gguf_path()
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.gguf_hf_config(reader)
    ours = dict(gguf_loader.gguf_tensors(reader, config))
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).state_dict()
    names = [n for n in ref if n != "lm_head.weight"]  # tied to the embedding
    assert set(names) == set(ours)
    for name in names:
        assert torch.equal(ours[name], ref[name].float()), name


@pytest.mark.parametrize("kind", ["llama3", "qwen2", "mistral", "head_dim_48"])
def test_tiny_random_checkpoints_match_transformers(tmp_path, kind):
    import transformers

    common = dict(
        vocab_size=49152,  # reuse the default tokenizer
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    if kind == "llama3":
        config = transformers.LlamaConfig(
            **common,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
        cls = transformers.LlamaForCausalLM
    elif kind == "qwen2":
        config = transformers.Qwen2Config(**common)
        cls = transformers.Qwen2ForCausalLM
    elif kind == "mistral":
        config = transformers.MistralConfig(**common, sliding_window=None)
        cls = transformers.MistralForCausalLM
    else:  # rotary half-rows of 24: not the native layer's 16-lane multiple, so the op path
        config = transformers.LlamaConfig(**common, head_dim=48)
        cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    ref = cls(config).eval()
    with torch.no_grad():  # larger random weights so greedy paths are not all the same token
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ref.save_pretrained(str(tmp_path), max_shard_size="2MB")  # sharded safetensors
    assert (tmp_path / "model.safetensors.index.json").is_file()
    from quill.model.default_model import default_model_dir

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text((default_model_dir() / name).read_text())

    llm = LLM(
        str(tmp_path),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_memory=16 << 20,
    )
    prompts = [[5, 17, 300, 4000], list(range(100, 190))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        t = torch.tensor([ids])
        with torch.inference_mode():
            expected = ref.generate(
                t,
                attention_mask=torch.ones_like(t),
                max_new_tokens=8,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist(), kind


def test_a_head_dim_the_fused_native_layer_cannot_take_runs_on_the_op_path(tmp_path, model_dir):
    """head_dim 48: rotary half-rows of 24 lanes, which quill::decoder_stack's rope cannot
    take (16-lane multiples); int8 weights would otherwise qualify every layer for it."""
    import json

    from quill.model.default_model import default_model_dir

    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6, head_dim=48)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        tokenizer=str(default_model_dir()),
        quantization="int8",
        kv_cache_memory=16 << 20,
    )
    assert llm.engine.worker.runner.model.layers[0]._native_weights() is None
    out = llm.generate([[5, 17, 300]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=scaling,
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(
        ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    assert torch.allclose(ours, ref.float(), rtol=1e-6)


def test_dummy_weights_from_config_alone(tmp_path, model_dir):
    write_tiny_config(tmp_path, model_dir, hidden_size=128)
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        dtype="float32",
        kv_cache_memory=8 << 20,
        tokenizer=str(model_dir),
    )
    assert not list(tmp_path.glob("*.safetensors"))
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_load_gguf_directly(tmp_path):
    """LLM() on the GGUF file itself: dequantized fp32 weights, the tokenizer from its metadata."""
    from quill.model.default_model import default_gguf_path

    llm = LLM(str(default_gguf_path()), dtype="float32", kv_cache_memory=16 << 20)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=3, temperature=0))
    assert out[0].outputs[0].text.strip().startswith("Paris")
