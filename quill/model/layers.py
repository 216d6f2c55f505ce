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


def rope_tables(
    config: ModelConfig, max_positions: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary cos and sin tables (positions x head_dim), computed in fp32 on the CPU.

    A model built on the meta device, for its shapes alone (quill.model.loader), gets empty
    ones: arithmetic on meta tensors runs torch's Python references, whose first use imports
    torch._dynamo, a second of every start that serving never needs."""
    inv_freq = rope_inv_freq(config)
    shape = (max_positions, 2 * inv_freq.numel())
    if device.type == "meta":
        return torch.empty(shape, device=device), torch.empty(shape, device=device)
    freqs = torch.outer(torch.arange(max_positions, dtype=torch.float, device="cpu"), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """The rotary frequencies (head_dim / 2, fp32, on the CPU), scaled as the config says."""
    dim = config.head_dim
    steps = torch.arange(0, dim, 2, dtype=torch.float, device="cpu")
    inv_freq = 1.0 / (config.rope_theta ** (steps / dim))
    scaling = config.rope_scaling
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "freq_factors":  # GGUF's rope_freqs tensor: one divisor per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float, device="cpu")
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
