"""Reading GGUF files: metadata to a Hugging Face config, tensors dequantized to HF names."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from quill.contract.errors import ModelLoadError
from quill.model.gguf_config import (
    GGUF_ARCHITECTURES,
    _dequantize,
    _field,
    gguf_architecture,
    gguf_hf_config,
    open_gguf,
)
from quill.model.gguf_file import GGUFFile
from quill.model.stored import StoredTensor
from quill.ops import kquant, qlinear
from quill.ops.gguf_types import BLOCK32_TYPES, FLOAT_TYPES, QUANT_BLOCK_BYTES

# The metadata readers live in the torch-free gguf_config; re-exported for existing callers.
__all__ = [
    "GGUF_ARCHITECTURES",
    "_field",
    "gguf_architecture",
    "gguf_hf_config",
    "gguf_tensors",
    "load_gguf_tokenizer",
    "open_gguf",
]

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
    "attn_q_norm": "self_attn.q_norm",  # Qwen3
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_inp": "mlp.gate",  # Qwen3-MoE's router
}
# Gemma 3's four norms a layer (ffn_norm is the one before its MLP).
_GEMMA3_TENSORS = {
    **_LAYER_TENSORS,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
# Qwen3-MoE's experts, stacked in one tensor each ([experts, rows, columns]).
_EXPERT_TENSORS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    # llama.cpp's converter interleaves the rotary halves of q and k rows; undo it.
    rows = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


def gguf_tensors(
    reader: GGUFFile, config: dict, skip: frozenset[str] = frozenset()
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (Hugging Face name, float32 tensor) for every weight in the file but those named
    in `skip` (the ones used as stored: never dequantized)."""
    arch = gguf_architecture(reader)
    layer_tensors = _GEMMA3_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    for t in reader.tensors:
        if t.name == "rope_freqs.weight" or _hf_name(t.name, arch) in skip:
            continue
        name = _GLOBAL_TENSORS.get(t.name)
        w = _dequantize(t)
        if arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1  # llama.cpp's converter stores Gemma's norms as 1 + w
        parts = t.name.split(".")  # blk.N.kind.weight|bias
        if name is None and len(parts) == 4 and parts[2] in _EXPERT_TENSORS:
            for expert, rows in enumerate(w):  # one Hugging Face tensor per expert
                hf = f"model.layers.{parts[1]}.mlp.experts.{expert}.{_EXPERT_TENSORS[parts[2]]}"
                yield f"{hf}.{parts[3]}", torch.from_numpy(np.array(rows, dtype=np.float32))
            continue
        if name is None:
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_tensors:
                raise ModelLoadError(f"unexpected tensor {t.name!r} in GGUF file")
            name = f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
            if arch == "llama" and parts[2] == "attn_q":
                w = _unpermute(w, config["num_attention_heads"])
            elif arch == "llama" and parts[2] == "attn_k":
                w = _unpermute(w, config["num_key_value_heads"])
        yield name, torch.from_numpy(np.array(w, dtype=np.float32))  # a writable copy


def _hf_name(gguf_name: str, arch: str) -> str | None:
    """The Hugging Face name of a 2-D tensor of the file (None for stacked experts and names
    quill does not map)."""
    name = _GLOBAL_TENSORS.get(gguf_name)
    if name is not None:
        return name
    layer_tensors = _GEMMA3_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    parts = gguf_name.split(".")
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_tensors:
        return None
    return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"


def gguf_stored_tensors(reader: GGUFFile, config: dict) -> dict[str, StoredTensor]:
    """Hugging Face name -> the tensor as the file stores it, for every 2-D weight in a type a
    native kernel reads in place (quill/ops/kquant.py; floats by quill/model/stored.py's
    float_linear): views of the memory map, nothing read."""
    arch = gguf_architecture(reader)
    out = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        ggml_type = kquant.type_of(kind)
        if ggml_type is None:
            ggml_type = FLOAT_TYPES.get(kind)  # F32 / F16 / BF16: read by the float products
        name = _hf_name(t.name, arch)
        if t.name == "token_embd.weight" and ggml_type is None:
            # A table in blocks of 32 is looked up as stored too (its products are int8 / int4).
            ggml_type = BLOCK32_TYPES.get(kind)
        if ggml_type is None or name is None or t.data.ndim != 2 or not name.endswith(".weight"):
            continue
        with warnings.catch_warnings():  # the map is read-only, and is only ever read
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(t.data.view(np.uint8))  # floats: their bytes, as blocks
        row_map = None
        kind = t.name.split(".")[-2]
        if arch == "llama" and kind in ("attn_q", "attn_k"):
            heads = config["num_attention_heads" if kind == "attn_q" else "num_key_value_heads"]
            order = _unpermute(np.arange(t.data.shape[0]), heads)  # HF row i: file row order[i]
            inverse = np.empty_like(order)
            inverse[order] = np.arange(order.size)
            row_map = torch.from_numpy(inverse.astype(np.int32))
        out[name] = StoredTensor(data, ggml_type, row_map)
    return out


def decode_blocks(kind: str, data: np.ndarray) -> tuple[torch.Tensor, ...]:
    """A tensor's raw blocks -> for the int8 types (Q8_0, Q5_0, IQ4_NL): (codes int8, scales
    fp16); Q4_x: (codes 0..15, d, c) with w = d * code + c; per row and block of 32
    (qlinear.block_codes)."""
    rows = data.shape[0]
    with warnings.catch_warnings():  # the map is read-only; block_codes copies what it keeps
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.ascontiguousarray(data))
    codes, d, c = qlinear.block_codes(
        raw.reshape(rows, -1, QUANT_BLOCK_BYTES[kind]), BLOCK32_TYPES[kind]
    )
    codes = codes.reshape(rows, -1)
    return (codes, d) if c is None else (codes, d, c)


@dataclass
class BlockTensor:
    """A tensor of the file stored in Q8_0, Q4_0 or Q4_1, not yet read: `decode()` reads it
    (rows in Hugging Face order) and `data` is its view of the map (to release after)."""

    name: str  # Hugging Face name
    kind: str
    data: np.ndarray
    heads: int | None  # Llama's q / k: the heads whose rotary rows the converter permuted

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    def decode(self) -> tuple[torch.Tensor, ...]:
        tensors = decode_blocks(self.kind, self.data)
        if self.heads is None:
            return tensors
        return tuple(torch.from_numpy(_unpermute(x.numpy(), self.heads)) for x in tensors)


def gguf_block_tensors(reader: GGUFFile, config: dict) -> list[BlockTensor]:
    """Every tensor stored in Q8_0, Q4_0 or Q4_1, unread: int8 and int4 weights take their
    blocks as they are, not re-quantized from a float copy (which rounded them once more, to
    the model's dtype)."""
    arch = gguf_architecture(reader)
    layer_tensors = _GEMMA3_TENSORS if arch == "gemma3" else _LAYER_TENSORS
    out = []
    for t in reader.tensors:
        kind = t.tensor_type.name
        if kind not in QUANT_BLOCK_BYTES:
            continue
        name = _GLOBAL_TENSORS.get(t.name)
        parts = t.name.split(".")
        if name is None and len(parts) == 4 and parts[2] in _EXPERT_TENSORS:
            continue  # stacked: quantized per expert from their floats instead
        if name is None:
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in layer_tensors:
                raise ModelLoadError(f"unexpected tensor {t.name!r} in GGUF file")
            name = f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{parts[3]}"
        heads = None
        if arch == "llama" and parts[-2] in ("attn_q", "attn_k"):
            kind_of_heads = (
                "num_attention_heads" if parts[-2] == "attn_q" else "num_key_value_heads"
            )
            heads = config[kind_of_heads]
        out.append(BlockTensor(name, kind, t.data, heads))
    return out


def load_gguf_tokenizer(path: str | Path):
    """A fast tokenizer built by transformers from the file's vocabulary, merges and template."""
    from transformers import AutoTokenizer

    path = Path(path)
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
