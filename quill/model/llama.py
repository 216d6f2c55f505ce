"""The Llama family's forward pass in plain PyTorch over a flat batch of tokens: Llama,
Mistral, Qwen2 / Qwen2.5 (QKV biases), Qwen3 (q/k norms), Phi-3 (fused in the checkpoint).

RMSNorm, rotary embeddings (with Llama-3 / linear scaling), grouped-query attention through the
paged cache, SwiGLU MLP. Q, K and V share one merged projection, as do the MLP's gate and up.
Every projection is a linear module, so a quantized one swaps in without touching this file.
The paged cache and the step's attention layout come in as arguments.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from quill.contract.errors import ModelLoadError
from quill.model.attention import AttentionMetadata, paged_attention
from quill.model.config import ModelConfig
from quill.model.layers import RMSNorm, rope_tables
from quill.model.linear import Linear, MergedLinear, dense, native_possible
from quill.ops import fused


class Target(NamedTuple):
    """Where a checkpoint tensor goes: our parameter, and the rows it fills there."""

    param: str
    offset: int
    rows: int


def weight_target(name: str, config: ModelConfig) -> Target | None:
    """Our parameter for a Hugging Face tensor name (None: a tensor to skip). The merged
    projections take Llama's separate q/k/v and gate/up tensors, or Phi-3's fused ones."""
    q = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    inter, hidden = config.intermediate_size, config.hidden_size
    if name == "model.embed_tokens.weight":
        return Target("embed_tokens.weight", 0, config.vocab_size)
    if name == "model.norm.weight":
        return Target("norm.weight", 0, hidden)
    if name == "lm_head.weight":
        tied = config.tie_word_embeddings
        return None if tied else Target("lm_head.weight", 0, config.vocab_size)
    if "rotary_emb" in name:
        return None
    idx, kind, suffix = split_layer_name(name, config)
    table = {
        "self_attn.q_proj": ("qkv_proj", 0, q),
        "self_attn.k_proj": ("qkv_proj", q, kv),
        "self_attn.v_proj": ("qkv_proj", q + kv, kv),
        "self_attn.qkv_proj": ("qkv_proj", 0, q + 2 * kv),  # Phi-3
        "self_attn.q_norm": ("q_norm", 0, config.head_dim),  # Qwen3
        "self_attn.k_norm": ("k_norm", 0, config.head_dim),
        "self_attn.o_proj": ("o_proj", 0, hidden),
        "mlp.gate_proj": ("gate_up_proj", 0, inter),
        "mlp.up_proj": ("gate_up_proj", inter, inter),
        "mlp.gate_up_proj": ("gate_up_proj", 0, 2 * inter),  # Phi-3
        "mlp.down_proj": ("down_proj", 0, hidden),
        "input_layernorm": ("input_layernorm", 0, hidden),
        "post_attention_layernorm": ("post_attention_layernorm", 0, hidden),
    }
    if kind not in table:
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
    param, offset, rows = table[kind]
    return Target(f"layers.{idx}.{param}.{suffix}", offset, rows)


def split_layer_name(name: str, config: ModelConfig) -> tuple[int, str, str]:
    """ "model.layers.3.self_attn.q_proj.weight" -> (3, "self_attn.q_proj", "weight")."""
    if not name.startswith("model.layers."):
        raise ModelLoadError(f"unexpected tensor {name!r} in checkpoint")
    _, _, idx, rest = name.split(".", 3)
    if int(idx) >= config.num_layers:
        raise ModelLoadError(f"tensor {name!r} is beyond the model's {config.num_layers} layers")
    kind, _, suffix = rest.rpartition(".")
    return int(idx), kind, suffix


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        hidden = config.hidden_size
        self.scale = config.head_dim**-0.5
        self.window = config.sliding_window or 0
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        parts = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = MergedLinear(hidden, parts, config.attention_bias)
        # Qwen3's: q and k normalised per head, before RoPE.
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.init_mlp(config)
        # The rank group when the layer holds one rank's slices (quill/distributed/shard.py):
        # o and down then give partial sums, added up over the ranks.
        self.tp = None

    def init_mlp(self, config: ModelConfig) -> None:
        """The dense SwiGLU MLP (a family with another MLP overrides this and `mlp`)."""
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h)
        return self.down_proj(fused.silu_mul(gate, up))

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's output, not yet added to the residual stream (for the first
        layer, the embeddings and a zero residual). Returns (output, residual)."""
        n = x.shape[0]
        weights = self._native_weights()
        if weights is not None and n <= weights[-1] and meta.reference is None:
            return self._native_layer(x, residual, cos, sin, kv_cache, meta, weights[:-1]), residual
        q, k, v = self.qkv_proj(self.input_layernorm(x, residual))
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim))
            k = self.k_norm(k.reshape(-1, self.head_dim))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        q, k = fused.rope(q, k, cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache, meta, self.scale)
        o = self.o_proj(attn.view(n, self.q_size))
        if self.tp is not None:
            self.tp.all_reduce(o)
        out = self.mlp(self.post_attention_layernorm(o, residual))
        if self.tp is not None:
            self.tp.all_reduce(out)
        return out, residual

    def _native_weights(self) -> tuple | None:
        """The layer's weights for quill::decoder_layer, and the rows up to which all its
        products run natively; None where the layer does not qualify (a product on F.linear,
        biases, no native library). Looked up once: quantization and the measured row counts
        are settled before the first step."""
        if not hasattr(self, "_native_cache"):
            self._native_cache = _native_layer_weights(self)
        return self._native_cache

    def _native_layer(self, x, residual, cos, sin, kv_cache, meta, weights) -> torch.Tensor:
        qkv, o, gate_up, down = weights
        k_cache, v_cache = kv_cache
        return torch.ops.quill.decoder_layer(
            x,
            residual,
            self.input_layernorm.weight,
            self.post_attention_layernorm.weight,
            self.input_layernorm.eps,
            qkv,
            o,
            gate_up,
            down,
            self.num_heads,
            self.num_kv_heads,
            self.gate_up_proj.parts[0],
            cos,
            sin,
            k_cache,
            v_cache,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
        )


def _native_layer_weights(layer: DecoderLayer) -> tuple | None:
    from quill.model.quant import QuantizedLinear

    if layer.tp is not None:  # the fused layer has no place for the all-reduces
        return None
    if layer.q_norm is not None or layer.window or not hasattr(layer, "gate_up_proj"):
        return None  # q/k norms, a sliding window, a sparse MLP: the fused layer has none
    if (layer.head_dim // 2) % 16:  # its rotary embedding takes half-rows of 16 lanes
        return None
    linears = (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)
    norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
    if any(m.bias is not None for m in linears) or not fused.use_native(norms[0]):
        return None
    if norms[0].dtype != norms[1].dtype:
        return None
    weights, limits = [], []
    for m in linears:
        if isinstance(m, QuantizedLinear) and m.native and m.method in ("int8", "int4"):
            packed = m.packed
            third = packed.sums if m.method == "int8" else packed.offsets
            weights.append([packed.codes, packed.scales, third])
            limits.append(m.max_rows if m.max_rows is not None else 1 << 62)
        elif isinstance(m, Linear) and m.native_max_rows > 0 and native_possible(m.weight):
            weights.append([m.weight])
            limits.append(m.native_max_rows)
        else:
            return None
    return (*weights, min(limits))


@dataclass
class NativeStack:
    """quill::decoder_stack's per-layer arguments, flattened in layer order."""

    norms: list[torch.Tensor]
    weights: list[torch.Tensor]
    tensors_per_weight: list[int]
    k_caches: list[torch.Tensor]
    v_caches: list[torch.Tensor]
    max_rows: int

    @staticmethod
    def of(layers, kv_caches: list) -> NativeStack | None:
        per_layer = [layer._native_weights() for layer in layers]
        if not per_layer or any(w is None for w in per_layer):
            return None
        norms = [
            n
            for layer in layers
            for n in (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
        ]
        products = [p for w in per_layer for p in w[:-1]]
        return NativeStack(
            norms,
            [t for p in products for t in p],
            [len(p) for p in products],
            [k for k, _ in kv_caches],
            [v for _, v in kv_caches],
            min(w[-1] for w in per_layer),
        )


class LlamaForCausalLM(nn.Module):
    """Returns hidden states for every token; `compute_logits` maps only the sampled rows."""

    native_max_rows = 0  # a tied head's rows for quill::dense_linear (quill/model/linear.py)

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        # Given an empty table, nn.Embedding skips its random init (every weight is loaded).
        table = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=table)
        self.layers = nn.ModuleList(self.make_layer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.init_rope(max_positions)

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return DecoderLayer(config)

    def init_rope(self, max_positions: int) -> None:
        """(Re)compute the rotary tables in fp32 on the model's device."""
        cos, sin = rope_tables(self.config, max_positions, self.norm.weight.device)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        metas: Sequence[AttentionMetadata],
    ) -> torch.Tensor:
        """`kv_caches` and `metas`: each layer's cache tensors and the metadata of its KV
        group (the same for every layer of a model of one group)."""
        x = self.embed_tokens(input_ids)
        # Like the reference, rotary tables are computed in fp32 and rounded to the model's dtype.
        cos = self.cos_cache[positions].to(x.dtype)
        sin = self.sin_cache[positions].to(x.dtype)
        residual = torch.zeros_like(x)  # 0 + x is x: every layer adds into the residual
        stack = self._native_stack(kv_caches)
        meta = metas[0]  # one group when the stack runs (none of its layers has a window)
        if stack is not None and x.shape[0] <= stack.max_rows and meta.reference is None:
            first = self.layers[0]
            x = torch.ops.quill.decoder_stack(
                x,
                residual,
                stack.norms,
                first.input_layernorm.eps,
                stack.weights,
                stack.tensors_per_weight,
                first.num_heads,
                first.num_kv_heads,
                first.gate_up_proj.parts[0],
                cos,
                sin,
                stack.k_caches,
                stack.v_caches,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
                meta.query_start_loc,
                first.scale,
            )
            return residual.add_(x)
        for layer, kv_cache, layer_meta in zip(self.layers, kv_caches, metas, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, layer_meta)
        return residual.add_(x)

    def _native_stack(self, kv_caches: list) -> NativeStack | None:
        """Every layer's weights for quill::decoder_stack, or None unless every layer takes
        quill::decoder_layer; looked up once per KV cache (the runner allocates it once)."""
        cached = self.__dict__.get("_stack_cache")
        if cached is None or cached[0] is not kv_caches:
            cached = (kv_caches, NativeStack.of(self.layers, kv_caches))
            self.__dict__["_stack_cache"] = cached
        return cached[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding table is the output head
            return dense(self.norm(hidden), self.embed_tokens.weight, None, self.native_max_rows)
        return self.lm_head(self.norm(hidden))
