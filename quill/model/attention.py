"""Attention over the paged KV cache, for a flat batch of tokens with no padding between them.

The runner lays each step out as decodes first (one query each), then prompt chunks, and builds
an `AttentionMetadata` once per step for each KV group (quill/contract/kv_groups.py: one table
per group, and the group's window); every layer receives its group's and its own cache tensors
as arguments (nothing is read from module state). Each layer writes the step's keys and values
into their cache slots and attends every query to its own sequence's keys, in one op:

- the native kernel (`quill::paged_attention`, csrc/attention.cpp) where the CPU has a built
  library: it reads each sequence's blocks in place through its block table, every query head
  of a GQA group sharing one read, causal inside prompt chunks, nothing padded or copied;
- else the PyTorch reference (quill/ops/reference.py): blocks gathered into workspaces and one
  scaled-dot-product attention per group, with an additive mask.

The cache layout (csrc/cache_layout.h) is the same for both, so either path reads a cache the
other wrote. The op is opaque to `torch.compile`, which compiles the dense rest of the model.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quill.contract.kv_groups import NULL_BLOCK
from quill.contract.plan import SeqPlan
from quill.ops import library, reference

log = logging.getLogger(__name__)


@dataclass
class AttentionMetadata:
    """The step's layout; tensors on the model's device. N = tokens, B = sequences."""

    slot_mapping: torch.Tensor  # [N] long: cache slot of each token (padding: the scratch block)
    block_tables: torch.Tensor | None  # [B, blocks] int32, in flat order (native path)
    seq_lens: torch.Tensor | None  # [B] int32: keys each sequence has after the step
    query_start_loc: torch.Tensor | None  # [B + 1] int32: first flat token of each sequence
    reference: reference.ReferenceMetadata | None  # the PyTorch path's layout, when it runs
    window: int = 0  # > 0: each query sees only its last `window` keys


def native_supported(
    device: torch.device,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    v_dtype: torch.dtype | None = None,
) -> str | None:
    """Why the native kernel cannot run this model here (None: it can); `dtype` the K
    cache's, `v_dtype` the V cache's (default the same)."""
    v_dtype = v_dtype or dtype
    if device.type != "cpu":
        return f"device {device.type}"
    lib = library.load()
    if lib is None:
        return "no native library"
    width = 16 if lib.isa == "avx512" else 8
    if head_dim % width or head_dim > 512:
        return f"head_dim {head_dim} (needs a multiple of {width} up to 512)"
    if block_size % width or block_size > 128:
        return f"block_size {block_size} (needs a multiple of {width} up to 128)"
    floats = (torch.float32, torch.bfloat16, torch.float16)
    for d in (dtype, v_dtype):
        if d not in (*floats, torch.int8):
            return f"dtype {d}"
    if dtype != v_dtype and torch.int8 not in (dtype, v_dtype):
        return f"K cache {dtype} beside V cache {v_dtype} (only int8 beside a float type)"
    return None


class AttentionLayout:
    """Builds each step's `AttentionMetadata` of one KV group for the path this model runs."""

    def __init__(
        self,
        block_size: int,
        scratch_block: int,
        dtype: torch.dtype,
        device: torch.device,
        native: bool,
        window: int = 0,
        group: int = 0,
    ) -> None:
        self.block_size = block_size
        self.window = window  # the group's sliding window (0: none)
        self.group = group  # which of a SeqPlan's block tables
        self.scratch_block = scratch_block  # padding in block tables and for padded tokens
        self.dtype = dtype  # the model's (the reference path's masks)
        self.device = device
        self.native = native
        self.workspace = reference.Workspace()

    def build(self, seqs: Sequence[SeqPlan], slot_mapping: torch.Tensor) -> AttentionMetadata:
        """`seqs` in flat order, decodes (one token) first."""
        g, window = self.group, self.window
        if not self.native:
            args = (seqs, self.block_size, self.scratch_block, self.dtype, self.device)
            ref = reference.build_reference_metadata(*args, self.workspace, window, g)
            return AttentionMetadata(slot_mapping, None, None, None, ref, window)
        max_blocks = max((len(s.block_tables[g]) for s in seqs), default=0)
        pad = [0] * max_blocks  # never read: the kernel reads a sequence's first seq_len keys
        tables = [s.block_tables[g] + pad[len(s.block_tables[g]) :] for s in seqs]
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + len(s.token_ids))
        dev = self.device
        table = torch.tensor(tables, dtype=torch.int32).view(len(seqs), max_blocks)
        if window:  # freed blocks behind the window are never read, but must be ids
            table.masked_fill_(table == NULL_BLOCK, self.scratch_block)
        return AttentionMetadata(
            slot_mapping,
            table.to(dev),
            torch.tensor([s.start + len(s.token_ids) for s in seqs], dtype=torch.int32, device=dev),
            torch.tensor(starts, dtype=torch.int32, device=dev),
            None,
            window,
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D], k and v [N, KVH, D] of this step's tokens; returns [N, H, D], each query
    attending to its keys within `meta.window`."""
    k_cache, v_cache = kv_cache
    if meta.reference is not None:
        ref = meta.reference
        return reference.paged_attention(q, k, v, k_cache, v_cache, meta.slot_mapping, ref, scale)
    return torch.ops.quill.paged_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        meta.window,
    )
