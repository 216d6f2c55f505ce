"""Gemma 3: the Llama layout with Gemma's changes, on the shared layers.

RMSNorm scales by (1 + w); four norms a layer (before and after attention and the MLP, the
"after" ones on the sublayer's output before it joins the residual stream); q and k
normalised per head before RoPE; embeddings times sqrt(hidden size); a GELU-tanh gated MLP;
attention scaled by 1 / sqrt(query_pre_attn_scalar); sliding-window layers (their own RoPE
base, each query seeing its last `window` keys) interleaved with global ones; tied
embeddings. Checkpoint names are Hugging Face's; a GGUF file's (1 + w) norms are turned back
into w when read (quill/model/gguf_loader.py), as transformers does.

EmbeddingGemma is the same layers with bidirectional attention (`use_bidirectional_attention`):
`Gemma3Encoder` keeps no KV cache and takes each prompt whole, every token seeing its whole
prompt on a global layer and the tokens within half the window either side on a sliding one
(transformers' mask: |i - j| <= window // 2).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from quill.model import llama
from quill.model.attention import AttentionMetadata, paged_attention
from quill.model.config import ModelConfig
from quill.model.layers import RMSNorm, rope_tables
from quill.model.linear import Linear, MergedLinear
from quill.model.prompt_attention import PromptGroups
from quill.ops import fused


class GemmaRMSNorm(RMSNorm):
    """x / rms(x) * (1 + w), the scale formed in fp32 as Hugging Face's Gemma3RMSNorm does."""

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        scale = (1.0 + self.weight.float()).to(x.dtype)
        if residual is None:
            return fused.rms_norm(x, scale, self.eps)
        return fused.add_rms_norm(x, residual, scale, self.eps)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.window = config.layer_windows[index]  # 0: a global layer
        self.scale = (config.query_pre_attn_scalar or config.head_dim) ** -0.5
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        parts = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = MergedLinear(hidden, parts, config.attention_bias)
        self.q_norm = GemmaRMSNorm(self.head_dim, eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, eps)
        self.o_proj = Linear(self.q_size, hidden, bias=False)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.tp = None  # tensor parallelism is refused for this family (quill/distributed)

    def forward(self, x, residual, cos, sin, kv_cache, meta: AttentionMetadata):
        """x: the previous layer's output, not yet in the residual stream. Returns (output,
        residual) as Llama's layer does. An encoder's step passes no cache and its prompts'
        groups as `meta`."""
        n = x.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(x, residual))
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(n, self.num_heads, self.head_dim)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(n, self.num_kv_heads, self.head_dim)
        q, k = fused.rope(q, k, cos, sin)
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        if kv_cache is None:
            attn = meta.attend(q, k, v, self.scale, self.window // 2)
        else:
            attn = paged_attention(q, k, v, kv_cache, meta, self.scale)
        o = self.post_attention_layernorm(self.o_proj(attn.view(n, self.q_size)))
        gate, up = self.gate_up_proj(self.pre_feedforward_layernorm(o, residual))
        out = self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.post_feedforward_layernorm(out), residual


class Gemma3ForCausalLM(llama.LlamaForCausalLM):
    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__(config, max_positions)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)

    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return Gemma3DecoderLayer(config, index)

    def init_rope(self, max_positions: int) -> None:
        """Two rotary tables: the global layers' base, and the sliding layers' own."""
        super().init_rope(max_positions)
        local = dataclasses.replace(
            self.config, rope_theta=self.config.local_rope_theta, rope_scaling=None
        )
        cos, sin = rope_tables(local, max_positions, self.norm.weight.device)
        self.register_buffer("local_cos_cache", cos, persistent=False)
        self.register_buffer("local_sin_cache", sin, persistent=False)

    def forward(
        self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ropes = self._ropes(positions, x.dtype)
        residual = torch.zeros_like(x)
        for layer, kv_cache, meta in zip(self.layers, kv_caches, metas, strict=True):
            cos, sin = ropes[layer.window > 0]
            x, residual = layer(x, residual, cos, sin, kv_cache, meta)
        return residual.add_(x)

    def _ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """The step's (cos, sin) rows: {sliding layer?: tables}."""
        return {
            False: (self.cos_cache[positions].to(dtype), self.sin_cache[positions].to(dtype)),
            True: (
                self.local_cos_cache[positions].to(dtype),
                self.local_sin_cache[positions].to(dtype),
            ),
        }


class Gemma3Encoder(Gemma3ForCausalLM):
    """Gemma 3 with bidirectional attention (EmbeddingGemma): no KV cache, each prompt whole
    (the runner's encoder path, as BERT's); the head is never used."""

    is_encoder = True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final norm's input for every token (the runner pools after `norm`)."""
        x = self.embed_tokens(input_ids)
        x = x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)
        ropes = self._ropes(positions, x.dtype)
        groups = PromptGroups(seq_lens, x.device)
        residual = torch.zeros_like(x)
        for layer in self.layers:
            cos, sin = ropes[layer.window > 0]
            x, residual = layer(x, residual, cos, sin, None, groups)
        return residual.add_(x)


_NORMS = {
    "input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
    "post_feedforward_layernorm", "self_attn.q_norm", "self_attn.k_norm",
}  # fmt: skip


def weight_target(name: str, config: ModelConfig) -> llama.Target | None:
    """Llama's names, plus Gemma's four norms a layer and its q/k norms. A Gemma3TextModel's
    checkpoint (EmbeddingGemma's) names its tensors without the `model.` prefix."""
    if config.architecture == "Gemma3TextModel" and not name.startswith("model."):
        name = f"model.{name}"
    if name.startswith("model.layers."):
        idx, kind, suffix = llama.split_layer_name(name, config)
        if kind in _NORMS:
            rows = config.head_dim if kind.startswith("self_attn.") else config.hidden_size
            return llama.Target(f"layers.{idx}.{kind.removeprefix('self_attn.')}.{suffix}", 0, rows)
    return llama.weight_target(name, config)
