"""A decoder layer's small operations (and the sampler's argmax, and scoring prompt rows): one
native op each where the library runs, else the PyTorch sequence they replace (the reference the
native ops are tested against).

At a small batch these cost their operators, not their arithmetic: PyTorch runs RMSNorm as
~8 operators and the rotary embedding as ~12, a few microseconds each, ~1,200 per step of the
default model (csrc/fused.cpp). The native ops round where the PyTorch sequences round, so a
model gives the same numbers through either path up to the order of a sum.

`use_native(x)` is decided per tensor: the CPU, the library loaded, a dtype and row length the
kernels take. The PyTorch functions are what runs on a GPU.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from quill.ops import library

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def use_native(x: torch.Tensor, multiple: int = 16) -> bool:
    return (
        x.device.type == "cpu"
        and x.dtype in _DTYPES
        and x.shape[-1] % multiple == 0
        and library.available()
    )


def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm: normalize in fp32, round to x's dtype, times the weight."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if use_native(x) and x.dim() == 2 and weight.dtype == x.dtype:
        return torch.ops.quill.rms_norm(x, weight, eps)
    return reference_rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place); returns the RMSNorm of the sum."""
    if use_native(x) and x.dim() == 2 and weight.dtype == x.dtype and x.stride(-1) == 1:
        return torch.ops.quill.add_rms_norm(x, residual, weight, eps)
    residual.add_(x)
    return reference_rms_norm(residual, weight, eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [tokens, heads, head_dim] rotated by cos / sin [tokens, head_dim] (HF's form)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def rope(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns q and k rotated: in place by the native op, as new tensors by PyTorch."""
    half = q.shape[-1] // 2
    if use_native(q) and cos.dtype == q.dtype and half % 16 == 0 and q.stride(-1) == 1:
        torch.ops.quill.rope(q, k, cos, sin)
        return q, k
    return reference_rope(q, cos, sin), reference_rope(k, cos, sin)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if use_native(gate) and gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:
        return torch.ops.quill.silu_mul(gate, up)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the sampler's greedy choice), as `x.argmax(-1)`: natively for fp32
    rows on the CPU (csrc/argmax.cpp; PyTorch's took 0.1 ms for one 49,152-logit row here)."""
    native = x.device.type == "cpu" and x.dtype == torch.float32 and library.available()
    if native and x.dim() == 2 and x.shape[1] > 0 and x.stride(1) == 1:
        return torch.ops.quill.argmax_rows(x)
    return x.argmax(dim=-1)


class RowScores(NamedTuple):
    """Per row of logits: the target's log-softmax (fp32) and rank (1 + the logits above it),
    the most likely token (the first of equal maxima) and its log-softmax."""

    logprob: torch.Tensor
    rank: torch.Tensor
    best: torch.Tensor
    best_logprob: torch.Tensor


def score(logits: torch.Tensor, targets: torch.Tensor) -> RowScores:
    """`RowScores` of rows of logits: natively for fp32 and bf16 rows on the CPU
    (csrc/logprobs.cpp; PyTorch's reductions cost as much as the output head's product here),
    else `score_reference`."""
    native = (
        logits.device.type == "cpu"
        and logits.dtype in (torch.float32, torch.bfloat16)
        and library.available()
    )
    if native and logits.dim() == 2 and logits.shape[1] > 0 and logits.stride(1) == 1:
        return RowScores(*torch.ops.quill.score_rows(logits, targets.contiguous()))
    return score_reference(logits, targets)


def score_reference(logits: torch.Tensor, targets: torch.Tensor) -> RowScores:
    """`score` in PyTorch: the reference the native op is tested against, and its fallback."""
    x = logits.float()
    target_logits = x.gather(1, targets[:, None])
    lse = x.logsumexp(dim=-1, keepdim=True)
    # Summed as int32: summing booleans to int64 takes twice as long.
    rank = torch.sum(x > target_logits, dim=-1, dtype=torch.int32).long() + 1
    best_logits, best = x.max(dim=-1, keepdim=True)
    return RowScores(
        (target_logits - lse).squeeze(1), rank, best.squeeze(1), (best_logits - lse).squeeze(1)
    )
