"""Reading GGUF files: metadata to a Hugging Face config, tensors dequantized to HF names."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from quill.errors import ModelLoadError

GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str | Path):
    import gguf

    try:
        return gguf.GGUFReader(str(path))
    except Exception as e:  # the reader raises bare ValueErrors on foreign files
        raise ModelLoadError(f"{str(path)!r} is not a readable GGUF file: {e}") from e


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def gguf_architecture(reader) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {arch!r}; quill reads {sorted(GGUF_ARCHITECTURES)}"
        )
    return arch


def gguf_hf_config(reader) -> dict:
    """The Hugging Face config.json equivalent of a GGUF file's metadata."""
    arch = gguf_architecture(reader)

    def get(key: str, default=None):
        return _field(reader, f"{arch}.{key}", default)

    tensor_names = {t.name for t in reader.tensors}
    num_heads = get("attention.head_count")
    hidden = get("embedding_length")
    vocab = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    config = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": int(hidden),
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": int(num_heads),
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("rope.dimension_count", hidden // num_heads)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    if "rope_freqs.weight" in tensor_names:  # Llama 3.1 style: per-frequency divisors
        t = next(t for t in reader.tensors if t.name == "rope_freqs.weight")
        config["rope_scaling"] = {
            "rope_type": "freq_factors",
            "factors": [float(x) for x in _dequantize(t)],
        }
    return config


def _dequantize(tensor) -> np.ndarray:
    from gguf.quants import dequantize

    return dequantize(tensor.data, tensor.tensor_type)


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the rotary halves of q and k rows; undo it.
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def gguf_tensors(reader, config: dict) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor) for every weight in the file."""
    arch = gguf_architecture(reader)
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = _GLOBAL_TENSORS.get(t.name)
        w = _dequantize(t)
        if name is None:
            parts = t.name.split(".")  # blk.N.kind.weight|bias
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _LAYER_TENSORS:
                raise ModelLoadError(f"unexpected tensor {t.name!r} in GGUF file")
            name = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{parts[3]}"
            if arch == "llama" and parts[2] == "attn_q":
                w = _unpermute(w, config["num_attention_heads"])
            elif arch == "llama" and parts[2] == "attn_k":
                w = _unpermute(w, config["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy


def load_gguf_tokenizer(path: str | Path):
    """A fast tokenizer built by transformers from the file's vocabulary, merges and template."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
