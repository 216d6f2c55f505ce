"""GGUF metadata to a Hugging Face config, without torch.

Split from gguf_loader (which turns tensors into torch tensors) so that tools which only need
the model's shape, like the cost model, can read a .gguf without importing torch.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from quill.contract.errors import ModelLoadError
from quill.model.gguf_file import GGUFFile

GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def open_gguf(path: str | Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except ModelLoadError:
        raise
    except Exception as e:  # truncated or foreign: struct, mmap and enum errors
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def _field(reader: GGUFFile, key: str, default=None):
    return reader.fields.get(key, default)


def gguf_architecture(reader: GGUFFile) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; quill reads {sorted(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_hf_config(reader: GGUFFile) -> dict:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    arch = gguf_architecture(reader)

    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"])
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(num_heads),
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(
            get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads
        ),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        # End of sequence, of turn and of message: generation stops at any of them.
        "eos_token_id": _end_ids(reader),
        "torch_dtype": "bfloat16",
    }
    if arch == "qwen3moe":
        config |= _moe_config(get, tensor_names, config["num_hidden_layers"])
    if arch == "gemma3":  # llama.cpp's: every sixth layer global, local RoPE base 10000
        config |= {
            "sliding_window": int(get("attention.sliding_window")),
            "sliding_window_pattern": 6,
            "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": config["head_dim"],
            "tie_word_embeddings": "output.weight" not in tensor_names,
        }
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1 style: per-frequency divisors
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config["rope_scaling"] = {
            "rope_type": "freq_factors",
            "factors": [float(x) for x in _dequantize(t)],
        }
    return config


def _moe_config(get, tensor_names: set[str], num_layers: int) -> dict:
    """A Qwen3-MoE file's experts; a layer with a dense MLP (ffn_gate) is one of
    mlp_only_layers. llama.cpp renormalises the chosen experts' weights unless told not to."""
    return {
        "num_experts": int(get("expert_count")),
        "num_experts_per_tok": int(get("expert_used_count")),
        "moe_intermediate_size": int(get("expert_feed_forward_length")),
        "norm_topk_prob": bool(get("expert_weights_norm", True)),
        "mlp_only_layers": [
            i for i in range(num_layers) if f"blk.{i}.ffn_gate.weight" in tensor_names
        ],
    }


def _end_ids(reader: GGUFFile) -> list[int]:
    keys = ("eos_token_id", "eot_token_id", "eom_token_id")
    ids = [_field(reader, f"tokenizer.ggml.{k}") for k in keys]
    return list(dict.fromkeys(int(i) for i in ids if i is not None))


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(tensor.data, tensor.tensor_type)
