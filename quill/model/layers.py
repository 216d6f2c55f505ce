"""Layers every model family shares: RMSNorm and the rotary frequencies (with their scalings).

The attention over the paged cache is quill/model/attention.py; the products are
quill/model/linear.py (and their quantized versions, quill/model/quant.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from quill.contract.errors import ModelLoadError
from quill.model.config import ModelConfig
from quill.ops import fused


class RMSNorm(nn.Module):
    """`norm(x)`, or `norm(x, residual)`: residual += x in place, and the norm of the sum (one
    native op where the library runs: quill/ops/fused.py)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


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
