"""The PyTorch implementation of paged attention: the reference the native kernel is tested
against, and the path that runs where there is no native library (no compiler, `QUILL_NATIVE=0`,
a GPU, a shape the kernel does not take).

The cache layout is the native kernel's (csrc/cache_layout.h), one for every path:

- fp32 / fp16: k [blocks, kv_heads, head_dim, block_size],
  v [blocks, kv_heads, block_size, head_dim]
- bf16: k [blocks, kv_heads, head_dim / 2, block_size, 2],
  v [blocks, kv_heads, block_size / 2, head_dim, 2]
  (rows interleaved in pairs, the layout of a bf16 dot product)
- int8: k [blocks, kv_heads, head_dim * 17 / 16, block_size],
  v [blocks, kv_heads, block_size * 17 / 16, head_dim]
  (each (block, KV head) chunk: the bf16 layout's codes, a byte each, then fp16 scales
  [head_dim / 32, block_size], one per 32 dimensions of a token's head); queries against int8
  keys are rounded to int16 per 32 dimensions as the native kernel's integer dot products take
  them

K and V may differ in dtype (int8 beside a float type).

Attention here is what quill ran before its kernels: each group of sequences (decodes; prompt
chunks) has its blocks gathered through the block tables into reused workspaces, turned into
the [batch, kv_heads, keys, head_dim] layout, and handed to one scaled-dot-product attention
with an additive mask over the padded tail (a boolean mask sends PyTorch's CPU kernel down a
path ~5x slower). A single prompt chunk with no cached context attends causally to its own
keys with no mask at all. It copies and pads what the native kernel reads in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from quill.contract.plan import SeqPlan

SCALE_GROUP = 32  # dimensions of a token's head sharing one int8 scale (csrc/cache_layout.h)


def kv_torch_dtype(element: str) -> torch.dtype:
    """A cache tensor's dtype for a KVCacheFormat element type (quill/contract/kv_format.py)."""
    return torch.int8 if element == "int8" else getattr(torch, element)


def kv_cache_shapes(
    num_blocks: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    v_dtype: torch.dtype | None = None,
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of one layer's K cache (in `dtype`) and V cache (`v_dtype`, else `dtype`)."""
    v_dtype = v_dtype or dtype
    n, h = num_blocks, num_kv_heads
    if torch.int8 in (dtype, v_dtype) and (head_dim % SCALE_GROUP or block_size % 16):
        raise ValueError(
            f"an int8 KV cache needs head_dim a multiple of {SCALE_GROUP} (not {head_dim}) "
            f"and block_size a multiple of 16 (not {block_size})"
        )
    if torch.bfloat16 in (dtype, v_dtype) and (head_dim % 2 or block_size % 2):
        raise ValueError("a bf16 KV cache needs an even head_dim and block_size")
    if dtype == torch.bfloat16:
        k = (n, h, head_dim // 2, block_size, 2)
    elif dtype == torch.int8:
        k = (n, h, head_dim // 16 * 17, block_size)
    else:
        k = (n, h, head_dim, block_size)
    if v_dtype == torch.bfloat16:
        v = (n, h, block_size // 2, head_dim, 2)
    elif v_dtype == torch.int8:
        v = (n, h, block_size // 16 * 17, head_dim)
    else:
        v = (n, h, block_size, head_dim)
    return k, v


def _pairs(cache: torch.Tensor) -> bool:
    return cache.dim() == 5


def cache_block_size(k_cache: torch.Tensor) -> int:
    return k_cache.shape[3]


def _head_dim(k_cache: torch.Tensor) -> int:
    if _pairs(k_cache):
        return k_cache.shape[2] * 2
    return k_cache.shape[2] // 17 * 16 if k_cache.dtype == torch.int8 else k_cache.shape[2]


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> int8 codes [..., head_dim] and fp16 scales [..., head_dim / 32]:
    per 32 dimensions s = fp16(max |x| / 127), codes round-half-even(x / s) in [-127, 127]
    (the native write_kv's arithmetic, in the same order: the same bytes)."""
    groups = x.float().unflatten(-1, (-1, SCALE_GROUP))
    scale16 = (groups.abs().amax(-1) / 127.0).to(torch.float16)
    scale = scale16.float().unsqueeze(-1)
    codes = torch.where(scale > 0, torch.round(groups / scale), 0.0).clamp_(-127, 127)
    return codes.to(torch.int8).flatten(-2), scale16


def _int8_round_trip(x: torch.Tensor) -> torch.Tensor:
    codes, scales = quantize_int8(x)
    decoded = codes.float().unflatten(-1, (-1, SCALE_GROUP)) * scales.float().unsqueeze(-1)
    return decoded.flatten(-2).to(x.dtype)


def key_parts(k_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 K cache's (or a gather of its chunks') codes as [..., head_dim / 2, block_size,
    2] and fp16 scales [..., head_dim / 32, block_size]: views, for writing."""
    dim, bs = _head_dim(k_cache), cache_block_size(k_cache)
    chunk = k_cache.flatten(-2)
    codes = chunk[..., : dim * bs].unflatten(-1, (dim // 2, bs, 2))
    return codes, chunk[..., dim * bs :].view(torch.float16).unflatten(-1, (dim // SCALE_GROUP, bs))


def value_parts(v_cache: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An int8 V cache's codes as [..., block_size / 2, head_dim, 2] and fp16 scales
    [..., head_dim / 32, block_size]: views, for writing."""
    dim = v_cache.shape[-1]
    chunk = v_cache.flatten(-2)
    codes = chunk[..., : block_size * dim].unflatten(-1, (block_size // 2, dim, 2))
    scales = chunk[..., block_size * dim :].view(torch.float16)
    return codes, scales.unflatten(-1, (dim // SCALE_GROUP, block_size))


def key_codes(k_cache: torch.Tensor) -> torch.Tensor:
    """An int8 K cache's codes as logical [..., block_size, head_dim] (a copy)."""
    codes = key_parts(k_cache)[0]  # [..., D / 2, S, 2] -> [..., S, D / 2, 2]
    return codes.transpose(-3, -2).flatten(-2)


def value_codes(v_cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """An int8 V cache's codes as logical [..., block_size, head_dim] (a copy)."""
    codes = value_parts(v_cache, block_size)[0]  # [..., S / 2, D, 2] -> [..., S / 2, 2, D]
    return codes.transpose(-2, -1).flatten(-3, -2)


def rounded_queries(q: torch.Tensor) -> torch.Tensor:
    """Queries as the native kernel multiplies them against an int8 key cache: per 32
    dimensions the fp32 scale max |q| / 32767 and int16 codes round-half-even(q / scale),
    decoded (its integer dot products see the same values)."""
    groups = q.float().unflatten(-1, (-1, SCALE_GROUP))
    scale = groups.abs().amax(-1, keepdim=True) / 32767.0
    codes = torch.where(scale > 0, torch.round(groups * (1 / scale)), 0.0).clamp_(-32767, 32767)
    return (codes * scale).flatten(-2).to(q.dtype)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v [tokens, kv_heads, head_dim] into their slots (block * block_size + offset)."""
    block_size = cache_block_size(k_cache)
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    n, heads, dim = k.shape
    if k_cache.dtype == torch.int8:
        codes, scales = quantize_int8(k)
        code_view, scale_view = key_parts(k_cache)
        code_view[blocks, :, :, offsets, :] = codes.unflatten(-1, (-1, 2))
        scale_view[blocks, :, :, offsets] = scales
    elif _pairs(k_cache):
        k_cache[blocks, :, :, offsets, :] = k.to(k_cache.dtype).reshape(n, heads, dim // 2, 2)
    else:
        k_cache[blocks, :, :, offsets] = k.to(k_cache.dtype)
    if v_cache.dtype == torch.int8:
        codes, scales = quantize_int8(v)
        code_view, scale_view = value_parts(v_cache, block_size)
        code_view[blocks, :, offsets // 2, :, offsets % 2] = codes
        scale_view[blocks, :, :, offsets] = scales
    elif _pairs(v_cache):
        v_cache[blocks, :, offsets // 2, :, offsets % 2] = v.to(v_cache.dtype)
    else:
        v_cache[blocks, :, offsets, :] = v.to(v_cache.dtype)


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    dtype: torch.dtype,
    workspace: Workspace | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's blocks as [batch, kv_heads, blocks * block_size, head_dim] in `dtype`
    (an int8 cache's codes times their scales)."""
    batch, num_blocks = tables.shape
    flat = tables.reshape(-1)
    heads, block_size = k_cache.shape[1], cache_block_size(k_cache)
    dim = _head_dim(k_cache)
    keys_raw = _index(k_cache, flat, workspace, "k_raw")
    values_raw = _index(v_cache, flat, workspace, "v_raw")
    if k_cache.dtype == torch.int8:
        # [B * n, H, S, D] codes times [B * n, H, D / 32, S] scales -> [B, H, n, S, D]
        scales = key_parts(keys_raw)[1]
        per_dim = scales.float().transpose(-1, -2).repeat_interleave(SCALE_GROUP, dim=-1)
        keys = (key_codes(keys_raw) * per_dim).view(batch, num_blocks, heads, block_size, dim)
        keys = keys.permute(0, 2, 1, 3, 4)
    elif _pairs(k_cache):
        # [B, n, H, D/2, S, 2] -> [B, H, n, S, D/2, 2]
        keys = keys_raw.view(batch, num_blocks, heads, dim // 2, block_size, 2)
        keys = keys.permute(0, 2, 1, 4, 3, 5)
    else:
        keys = keys_raw.view(batch, num_blocks, heads, dim, block_size).permute(0, 2, 1, 4, 3)
    if v_cache.dtype == torch.int8:
        # [B * n, H, S, D] codes times [B * n, H, D / 32, S] scales -> [B, H, n, S, D]
        scales = value_parts(values_raw, block_size)[1]
        per_dim = scales.float().transpose(-1, -2).repeat_interleave(SCALE_GROUP, dim=-1)
        codes = value_codes(values_raw, block_size)
        values = (codes * per_dim).view(batch, num_blocks, heads, block_size, dim)
        values = values.permute(0, 2, 1, 3, 4)
    elif _pairs(v_cache):
        # [B, n, H, S/2, D, 2] -> [B, H, n, S/2, 2, D]
        values = values_raw.view(batch, num_blocks, heads, block_size // 2, dim, 2)
        values = values.permute(0, 2, 1, 3, 5, 4)
    else:
        values = values_raw.view(batch, num_blocks, heads, block_size, dim).permute(0, 2, 1, 3, 4)
    shape = (batch, heads, num_blocks * block_size, dim)
    out_k = _buffer(workspace, "k", shape, dtype, k_cache.device)
    out_v = _buffer(workspace, "v", shape, dtype, k_cache.device)
    out_k.view(keys.shape).copy_(keys)
    out_v.view(values.shape).copy_(values)
    return out_k, out_v


class Workspace:
    """Reused gather buffers: large tensors allocated fresh every call are page-faulted every
    time (30 ms against 6 ms for 64 sequences' blocks, measured), so they grow by doubling."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, dtype: torch.dtype, device) -> torch.Tensor:
        buf = self.buffers.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            size = max(numel, 2 * buf.numel()) if buf is not None and buf.dtype == dtype else numel
            buf = torch.empty(size, dtype=dtype, device=device)
            self.buffers[name] = buf
        return buf[:numel]


def _buffer(workspace, name, shape, dtype, device) -> torch.Tensor:
    numel = 1
    for s in shape:
        numel *= s
    if workspace is None:
        return torch.empty(shape, dtype=dtype, device=device)
    return workspace.get(name, numel, dtype, device).view(shape)


def _index(cache: torch.Tensor, flat: torch.Tensor, workspace, name: str) -> torch.Tensor:
    shape = (flat.numel(), *cache.shape[1:])
    out = _buffer(workspace, name, shape, cache.dtype, cache.device)
    torch.index_select(cache, 0, flat, out=out)
    return out


@dataclass
class ReferenceMetadata:
    """The reference path's layout of a step. B = decodes, P = prompt chunks, Q = longest chunk."""

    decode_tables: torch.Tensor | None  # [B, blocks] long, padded with the scratch block
    decode_bias: torch.Tensor | None  # [B, 1, 1, blocks * block_size]: 0 visible, -inf hidden
    prefill_index: torch.Tensor | None  # [P, Q] long: flat token of query i of chunk p
    prefill_rows: torch.Tensor | None  # [T] long: rows of the [P * Q] queries that are real
    prefill_tables: torch.Tensor | None  # [P, blocks]; None: one chunk, no cached context
    prefill_bias: torch.Tensor | None  # [P, 1, Q, blocks * block_size]
    workspace: Workspace


def build_reference_metadata(
    seqs: Sequence[SeqPlan],
    block_size: int,
    scratch_block: int,
    dtype: torch.dtype,
    device: torch.device,
    workspace: Workspace,
    window: int = 0,
    group: int = 0,
) -> ReferenceMetadata:
    """`seqs` in flat order, decodes (one token) first; `window` > 0: sliding window masks;
    `group`: which of each sequence's block tables (its KV group's)."""
    decodes = [s for s in seqs if len(s.token_ids) == 1]
    chunks = seqs[len(decodes) :]
    decode_tables = decode_bias = None
    prefill_index = prefill_rows = prefill_tables = prefill_bias = None
    if decodes:
        decode_tables, decode_bias = _tables_and_bias(
            decodes, 1, block_size, scratch_block, dtype, device, window, group
        )
    if chunks:
        first = len(decodes)
        max_q = max(len(s.token_ids) for s in chunks)
        index, rows = [], []
        for p, s in enumerate(chunks):
            q = len(s.token_ids)
            index.append([first + min(i, q - 1) for i in range(max_q)])
            rows.extend(range(p * max_q, p * max_q + q))
            first += q
        prefill_index = torch.tensor(index, dtype=torch.long, device=device)
        prefill_rows = torch.tensor(rows, dtype=torch.long, device=device)
        if len(chunks) > 1 or chunks[0].start > 0 or 0 < window < max_q:
            prefill_tables, prefill_bias = _tables_and_bias(
                chunks, max_q, block_size, scratch_block, dtype, device, window, group
            )
    return ReferenceMetadata(
        decode_tables,
        decode_bias,
        prefill_index,
        prefill_rows,
        prefill_tables,
        prefill_bias,
        workspace,
    )


def _tables_and_bias(
    seqs: Sequence[SeqPlan],
    max_q: int,
    block_size: int,
    scratch_block: int,
    dtype,
    device,
    window: int = 0,
    group: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block tables padded with the scratch block (which also stands for the blocks freed
    behind a window), and the additive mask: query i of a sequence sits at position start + i
    and sees keys up to it, and with a window only its last `window` (padded queries repeat
    the last real one)."""
    max_blocks = max(len(s.block_tables[group]) for s in seqs)
    pad = [scratch_block] * max_blocks
    tables = torch.tensor(
        [s.block_tables[group] + pad[len(s.block_tables[group]) :] for s in seqs],
        dtype=torch.long,
    )
    if window:
        tables.masked_fill_(tables < 0, scratch_block)
    tables = tables.to(device)
    starts = torch.tensor([s.start for s in seqs], dtype=torch.long, device=device)
    q_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.long, device=device)
    query = torch.minimum(torch.arange(max_q, device=device)[None, :], (q_lens - 1)[:, None])
    last_visible = starts[:, None] + query  # [B, Q]
    keys = torch.arange(max_blocks * block_size, device=device)
    visible = keys[None, None, :] <= last_visible[:, :, None]  # [B, Q, C]
    if window > 0:
        visible &= keys[None, None, :] > last_visible[:, :, None] - window
    bias = torch.zeros(visible.shape, dtype=dtype, device=device)
    bias.masked_fill_(~visible, float("-inf"))
    return tables, bias.unsqueeze(1)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    meta: ReferenceMetadata,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D], k and v [N, KVH, D] of this step's tokens; returns [N, H, D]."""
    op = _paged_attention_op if torch.compiler.is_compiling() else _paged_attention
    return op(
        q,
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        meta.decode_tables,
        meta.decode_bias,
        meta.prefill_index,
        meta.prefill_rows,
        meta.prefill_tables,
        meta.prefill_bias,
        scale,
        meta.workspace,
    )


def _paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    decode_tables: torch.Tensor | None,
    decode_bias: torch.Tensor | None,
    prefill_index: torch.Tensor | None,
    prefill_rows: torch.Tensor | None,
    prefill_tables: torch.Tensor | None,
    prefill_bias: torch.Tensor | None,
    scale: float,
    workspace: Workspace | None = None,
) -> torch.Tensor:
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    out = torch.zeros_like(q)  # padding rows (compiled steps) stay zero
    if k_cache.dtype == torch.int8:  # as the native kernel multiplies them
        q = rounded_queries(q)
    num_decodes = 0
    if decode_tables is not None:
        num_decodes = decode_tables.shape[0]
        keys, values = gather_kv(k_cache, v_cache, decode_tables, q.dtype, workspace)
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
        # (as an int8 cache holds them, as the native kernel reads them)
        k = _int8_round_trip(k) if k_cache.dtype == torch.int8 else k
        v = _int8_round_trip(v) if v_cache.dtype == torch.int8 else v
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
    keys, values = gather_kv(k_cache, v_cache, prefill_tables, q.dtype, workspace)
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


# Opaque to torch.compile, which compiles the dense rest of the model around it; the workspace
# is no tensor, so compiled steps allocate their gathers.
_compiled_op = torch.library.custom_op(
    "quill_reference::paged_attention",
    lambda *args: _paged_attention(*args),
    mutates_args=("k_cache", "v_cache"),
    schema=(
        "(Tensor q, Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor slot_mapping, Tensor? decode_tables, Tensor? decode_bias, Tensor? prefill_index, "
        "Tensor? prefill_rows, Tensor? prefill_tables, Tensor? prefill_bias, float scale) -> Tensor"
    ),
)


@_compiled_op.register_fake
def _(q: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return torch.empty_like(q)


def _paged_attention_op(*args) -> torch.Tensor:
    return _compiled_op(*args[:-1])
