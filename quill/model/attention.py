"""Attention over the paged KV cache, for a flat batch of tokens with no padding.

The step's layout (which tokens belong to which sequence, where their keys go, which blocks each
sequence reads) is built once per step by the model runner and published here as the forward
context. The attention itself is a custom op, so that `torch.compile` treats it as one opaque
call and compiles the dense rest of the model around it for fixed token counts.

Sequences are attended in at most two groups: decodes (one query each) and prompt chunks (several
queries each). Each group gathers its sequences' blocks through their block tables into a
[batch, context] tensor and runs one scaled-dot-product attention with a mask that is causal
inside the chunk and stops at each sequence's own context length.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionGroup:
    """Sequences attended together: `token_index[b, i]` is the flat index of query i of seq b."""

    token_index: torch.Tensor  # [B, Q] long
    valid: torch.Tensor | None  # [B, Q] bool, None when every query is real (decodes)
    out_index: torch.Tensor  # [T] long: flat indices of the real queries, in valid order
    block_tables: torch.Tensor  # [B, max_blocks] long, padded with the scratch block
    mask: torch.Tensor  # [B, 1, Q, max_blocks * block_size] bool


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] long: cache slot of each token's key and value
    groups: list[AttentionGroup]


@dataclass
class ForwardContext:
    metadata: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer [blocks, block_size, kvh, d]
    scale: float


_context: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext):
    global _context
    _context = ctx
    try:
        yield
    finally:
        _context = None


def build_group(
    token_index: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    block_tables: torch.Tensor,
    block_size: int,
) -> AttentionGroup:
    """Mask and indices for one group; all inputs are on the model's device."""
    num_queries = token_index.shape[1]
    context = block_tables.shape[1] * block_size
    key_pos = torch.arange(context, device=token_index.device)
    query_pos = torch.arange(num_queries, device=token_index.device)
    # Query i of a sequence sits at position context_len - q_len + i and sees keys up to it.
    last_visible = (context_lens - q_lens)[:, None] + query_pos[None, :]  # [B, Q]
    last_visible = torch.minimum(last_visible, (context_lens - 1)[:, None])
    mask = key_pos[None, None, :] <= last_visible[:, :, None]  # [B, Q, C]
    if num_queries == 1:
        valid = None
        out_index = token_index.reshape(-1)
    else:
        valid = query_pos[None, :] < q_lens[:, None]
        out_index = token_index[valid]
    return AttentionGroup(token_index, valid, out_index, block_tables, mask.unsqueeze(1))


def _attend_group(q, k_cache, v_cache, group: AttentionGroup, scale: float) -> torch.Tensor:
    batch, max_blocks = group.block_tables.shape
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    qg = q[group.token_index].transpose(1, 2)  # [B, H, Q, D]
    # index_select copies whole blocks; advanced indexing (cache[tables]) was 2-5x slower here.
    blocks = group.block_tables.reshape(-1)
    shape = (batch, max_blocks * block_size, num_kv_heads, head_dim)
    kg = k_cache.index_select(0, blocks).view(shape)
    vg = v_cache.index_select(0, blocks).view(shape)
    out = F.scaled_dot_product_attention(
        qg,
        kg.transpose(1, 2),
        vg.transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # [B, Q, H, D]
    return out.reshape(-1, *out.shape[2:]) if group.valid is None else out[group.valid]


@torch.library.custom_op("quill::paged_attention", mutates_args=())
def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    """q [N, H, D], k and v [N, KVH, D] of this step's tokens; returns [N, H, D]."""
    ctx = _context
    k_cache, v_cache = ctx.kv_caches[layer]
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = ctx.metadata.slot_mapping
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, v)
    out = torch.zeros_like(q)
    for group in ctx.metadata.groups:
        out.index_copy_(0, group.out_index, _attend_group(q, k_cache, v_cache, group, ctx.scale))
    return out


@paged_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int) -> torch.Tensor:
    return torch.empty_like(q)
