"""Attention over the paged KV cache, for a flat batch of tokens with no padding between them.

The runner lays each step out as decodes first (one query each), then prompt chunks, and builds
an `AttentionMetadata` once per step; every layer receives it and its own cache tensors as
arguments (nothing is read from module state). Each layer writes the step's keys and values
into the cache slots, then attends in at most two groups:

- decodes: their blocks are gathered through the block tables into a reused workspace (fresh
  large buffers are page-faulted on every call) and one scaled-dot-product attention runs with
  an additive float mask that hides each sequence's padded tail. A boolean mask sends PyTorch's
  CPU kernel down a path ~5x slower (1.8 ms for one decode of 48 tokens, against 0.05 ms);
- prompt chunks: a single chunk with no cached context attends causally to its own keys with no
  mask at all (the common case, and the fastest kernel); otherwise the chunks' blocks are
  gathered like the decodes' and the mask is causal inside each chunk.

The whole thing is one custom op, so `torch.compile` treats attention as opaque and compiles
the dense rest of the model around it; the op declares the caches and workspaces it writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quill.engine.plan import SeqPlan


@dataclass
class AttentionMetadata:
    """The step's layout; tensors on the model's device. N = tokens, B = decodes, P = chunks."""

    slot_mapping: torch.Tensor  # [N] long: cache slot of each token (padding: the scratch block)
    decode_tables: torch.Tensor | None  # [B, blocks] long, padded with the scratch block
    decode_bias: torch.Tensor | None  # [B, 1, 1, blocks * block_size]: 0 visible, -inf hidden
    prefill_index: torch.Tensor | None  # [P, Q] long: flat token of query i of chunk p
    prefill_rows: torch.Tensor | None  # [T] long: rows of the [P * Q] queries that are real
    prefill_tables: torch.Tensor | None  # [P, blocks]; None: one chunk, no cached context
    prefill_bias: torch.Tensor | None  # [P, 1, Q, blocks * block_size]
    key_buffer: torch.Tensor  # [blocks, block_size, kv_heads, head_dim] gather workspace
    value_buffer: torch.Tensor


class AttentionLayout:
    """Builds each step's `AttentionMetadata` and owns the gather workspaces it points to."""

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        scratch_block: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.scratch_block = scratch_block  # padding in block tables and for padded tokens
        self.dtype = dtype
        self.device = device
        self.key_buffer = torch.empty(0, dtype=dtype, device=device)
        self.value_buffer = torch.empty(0, dtype=dtype, device=device)

    def build(self, seqs: Sequence[SeqPlan], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """`seqs` in flat order, decodes (one token) first."""
        decodes = [s for s in seqs if len(s.token_ids) == 1]
        chunks = seqs[len(decodes) :]
        decode_tables = decode_bias = None
        prefill_index = prefill_rows = prefill_tables = prefill_bias = None
        gathered = 0
        if decodes:
            decode_tables, decode_bias = self._tables_and_bias(decodes, 1)
            gathered = decode_tables.numel()
        if chunks:
            dev = self.device
            first = len(decodes)
            max_q = max(len(s.token_ids) for s in chunks)
            index, rows = [], []
            for p, s in enumerate(chunks):
                q = len(s.token_ids)
                index.append([first + min(i, q - 1) for i in range(max_q)])
                rows.extend(range(p * max_q, p * max_q + q))
                first += q
            prefill_index = torch.tensor(index, dtype=torch.long, device=dev)
            prefill_rows = torch.tensor(rows, dtype=torch.long, device=dev)
            if len(chunks) > 1 or chunks[0].start > 0:
                prefill_tables, prefill_bias = self._tables_and_bias(chunks, max_q)
                gathered = max(gathered, prefill_tables.numel())
        self._ensure_workspace(gathered)
        return AttentionMetadata(
            slot_mapping,
            decode_tables,
            decode_bias,
            prefill_index,
            prefill_rows,
            prefill_tables,
            prefill_bias,
            self.key_buffer,
            self.value_buffer,
        )

    def _tables_and_bias(
        self, seqs: Sequence[SeqPlan], max_q: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Block tables padded with the scratch block, and the additive mask: query i of a
        sequence sits at position start + i and sees keys up to it (padded queries repeat the
        last real one)."""
        dev = self.device
        max_blocks = max(len(s.block_table) for s in seqs)
        tables = torch.tensor(
            [
                s.block_table + [self.scratch_block] * (max_blocks - len(s.block_table))
                for s in seqs
            ],
            dtype=torch.long,
            device=dev,
        )
        starts = torch.tensor([s.start for s in seqs], dtype=torch.long, device=dev)
        q_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.long, device=dev)
        query = torch.minimum(torch.arange(max_q, device=dev)[None, :], (q_lens - 1)[:, None])
        last_visible = starts[:, None] + query  # [B, Q]
        keys = torch.arange(max_blocks * self.block_size, device=dev)
        visible = keys[None, None, :] <= last_visible[:, :, None]  # [B, Q, C]
        bias = torch.zeros(visible.shape, dtype=self.dtype, device=dev)
        bias.masked_fill_(~visible, float("-inf"))
        return tables, bias.unsqueeze(1)

    def _ensure_workspace(self, num_blocks: int) -> None:
        """Grow the gather workspaces (by doubling, so a growing batch reallocates rarely)."""
        if self.key_buffer.shape[0] >= num_blocks:
            return
        size = max(num_blocks, 2 * self.key_buffer.shape[0])
        shape = (size, *(self.block_size, self.num_kv_heads, self.head_dim))
        self.key_buffer = torch.empty(shape, dtype=self.dtype, device=self.device)
        self.value_buffer = torch.empty(shape, dtype=self.dtype, device=self.device)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D], k and v [N, KVH, D] of this step's tokens; returns [N, H, D]."""
    op = _paged_attention_op if torch.compiler.is_compiling() else _paged_attention
    return op(
        q,
        k,
        v,
        kv_cache[0],
        kv_cache[1],
        meta.key_buffer,
        meta.value_buffer,
        meta.slot_mapping,
        meta.decode_tables,
        meta.decode_bias,
        meta.prefill_index,
        meta.prefill_rows,
        meta.prefill_tables,
        meta.prefill_bias,
        scale,
    )


def _gather(cache: torch.Tensor, tables: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """[B, blocks * block_size, KVH, D] copy of each sequence's blocks, in the workspace."""
    batch, num_blocks = tables.shape
    out = buffer[: batch * num_blocks]
    torch.index_select(cache, 0, tables.reshape(-1), out=out)
    return out.view(batch, num_blocks * cache.shape[1], *cache.shape[2:])


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    key_buffer: torch.Tensor,
    value_buffer: torch.Tensor,
    slot_mapping: torch.Tensor,
    decode_tables: torch.Tensor | None,
    decode_bias: torch.Tensor | None,
    prefill_index: torch.Tensor | None,
    prefill_rows: torch.Tensor | None,
    prefill_tables: torch.Tensor | None,
    prefill_bias: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    out = torch.zeros_like(q)  # padding rows (compiled steps) stay zero
    num_decodes = 0
    if decode_tables is not None:
        num_decodes = decode_tables.shape[0]
        keys = _gather(k_cache, decode_tables, key_buffer).transpose(1, 2)
        values = _gather(v_cache, decode_tables, value_buffer).transpose(1, 2)
        res = F.scaled_dot_product_attention(
            q[:num_decodes].unsqueeze(2),  # [B, H, 1, D]
            keys,
            values,
            attn_mask=decode_bias,
            scale=scale,
            enable_gqa=True,
        )
        out[:num_decodes] = res.squeeze(2)
    if prefill_index is None:
        return out
    num_chunks, num_queries = prefill_index.shape
    if prefill_tables is None:  # one chunk over no cached context: causal over its own keys
        rows = slice(num_decodes, num_decodes + num_queries)
        res = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1).unsqueeze(0),
            k[rows].transpose(0, 1).unsqueeze(0),
            v[rows].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[rows] = res[0].transpose(0, 1)
        return out
    keys = _gather(k_cache, prefill_tables, key_buffer).transpose(1, 2)
    values = _gather(v_cache, prefill_tables, value_buffer).transpose(1, 2)
    res = F.scaled_dot_product_attention(
        q[prefill_index].transpose(1, 2),  # [P, H, Q, D]
        keys,
        values,
        attn_mask=prefill_bias,
        scale=scale,
        enable_gqa=True,
    ).transpose(1, 2)  # [P, Q, H, D]
    real = res.reshape(num_chunks * num_queries, *res.shape[2:]).index_select(0, prefill_rows)
    out[num_decodes : num_decodes + real.shape[0]] = real
    return out


_paged_attention_op = torch.library.custom_op(
    "quill::paged_attention",
    _paged_attention,
    mutates_args=("k_cache", "v_cache", "key_buffer", "value_buffer"),
)


@_paged_attention_op.register_fake
def _(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(q)
