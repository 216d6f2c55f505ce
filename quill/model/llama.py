"""The Llama-family forward pass in plain PyTorch over a flat batch of tokens.

RMSNorm, rotary embeddings (with Llama-3 / linear scaling), grouped-query attention through the
paged cache, SwiGLU MLP. Q, K and V share one merged projection, as do the MLP's gate and up.
Every projection is a linear module, so a quantized one swaps in without touching this file.
The paged cache and the step's attention layout come in as arguments.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from quill.errors import ModelLoadError
from quill.model.attention import AttentionMetadata, paged_attention
from quill.model.config import ModelConfig
from quill.model.linear import MergedLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: one divisor per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float)
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
        return torch.where(medium, smoothed, scaled)
    raise ModelLoadError(f"unsupported rope_scaling type {kind!r}")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


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
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        parts = [self.q_size, self.kv_size, self.kv_size]
        self.qkv_proj = MergedLinear(hidden, parts, config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, hidden, bias=False)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        inter = config.intermediate_size
        self.gate_up_proj = MergedLinear(hidden, [inter, inter], bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, hidden, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(self.input_layernorm(x))
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        v = v.reshape(n, self.num_kv_heads, self.head_dim)
        attn = paged_attention(q, k, v, kv_cache, meta, self.scale)
        x = x + self.o_proj(attn.view(n, self.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x))
        return x + self.down_proj(F.silu(gate) * up)


class LlamaForCausalLM(nn.Module):
    """Returns hidden states for every token; `compute_logits` maps only the sampled rows."""

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.cos_cache: torch.Tensor
        self.sin_cache: torch.Tensor
        self.init_rope(max_positions)

    def init_rope(self, max_positions: int) -> None:
        """(Re)compute the rotary tables in fp32 on the model's device."""
        device = self.norm.weight.device
        inv_freq = rope_inv_freq(self.config).to(device)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device=device), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        # Like the reference, rotary tables are computed in fp32 and rounded to the model's dtype.
        cos = self.cos_cache[positions].to(x.dtype).unsqueeze(1)
        sin = self.sin_cache[positions].to(x.dtype).unsqueeze(1)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x = layer(x, cos, sin, kv_cache, meta)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:  # tied: the embedding table is the output head
            return F.linear(self.norm(hidden), self.embed_tokens.weight)
        return self.lm_head(self.norm(hidden))
