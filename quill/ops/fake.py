"""Fake (meta) kernels of the native ops: shapes and dtypes only, for torch.compile and opcheck.

Imported by `quill.ops.library.load` right after the library registers the ops.
"""

from __future__ import annotations

import torch

from quill.ops.gguf_types import BLOCK_BYTES, IQ4_XS, Q4_K, Q5_K, Q6_K


@torch.library.register_fake("quill::write_kv")
def _write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.register_fake("quill::paged_attention")
def _paged_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    slot_mapping,
    block_tables,
    seq_lens,
    query_start_loc,
    scale,
    window=0,
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::read_probe")
def _read_probe(buffer, num_threads, repeats, chunk_bytes=0) -> torch.Tensor:
    return buffer.new_empty(2, dtype=torch.float64)


@torch.library.register_fake("quill::q8_linear")
def _q8_linear(x, codes, scales, sums, bias=None, out_dtype=None) -> torch.Tensor:
    rows, n = x.shape[0], codes.shape[0] * codes.shape[2]  # codes [N/16, K/4, 16, 4]
    return x.new_empty(rows, n, dtype=out_dtype or x.dtype)


@torch.library.register_fake("quill::q4_linear")
def _q4_linear(x, codes, scales, offsets, bias=None, out_dtype=None) -> torch.Tensor:
    rows, n = x.shape[0], codes.shape[0] * codes.shape[3]  # codes [N/16, K/32, 4, 16, 4]
    return x.new_empty(rows, n, dtype=out_dtype or x.dtype)


@torch.library.register_fake("quill::q5_linear")
def _q5_linear(x, codes, scales, offsets, bias=None, out_dtype=None) -> torch.Tensor:
    rows, n = x.shape[0], codes.shape[0] * codes.shape[2]  # codes [N/16, K/4, 16, 4]
    return x.new_empty(rows, n, dtype=out_dtype or x.dtype)


@torch.library.register_fake("quill::dense_linear")
def _dense_linear(x, weight, bias=None, out_dtype=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype)


@torch.library.register_fake("quill::rms_norm")
def _rms_norm(x, weight, eps) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::add_rms_norm")
def _add_rms_norm(x, residual, weight, eps) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::rope")
def _rope(q, k, cos, sin) -> None:
    return None


@torch.library.register_fake("quill::silu_mul")
def _silu_mul(gate, up) -> torch.Tensor:
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::decoder_layer")
def _decoder_layer(x, residual, *args) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::decoder_stack")
def _decoder_stack(x, residual, *args) -> torch.Tensor:
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::argmax_rows")
def _argmax_rows(x) -> torch.Tensor:
    return x.new_empty(x.shape[0], dtype=torch.long)


@torch.library.register_fake("quill::score_rows")
def _score_rows(x, targets) -> tuple[torch.Tensor, ...]:
    rows = x.shape[0]
    logprob, rank = x.new_empty(rows, dtype=torch.float32), x.new_empty(rows, dtype=torch.long)
    return logprob, rank, torch.empty_like(rank), torch.empty_like(logprob)


@torch.library.register_fake("quill::kquant_linear")
def _kquant_linear(x, weight, type, row_map=None, bias=None, out_dtype=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype)


@torch.library.register_fake("quill::kquant_rows")
def _kquant_rows(weight, type, ids, dtype) -> torch.Tensor:
    per_row = BLOCK_BYTES[type]
    return weight.new_empty(ids.numel(), weight.shape[1] // per_row * 256, dtype=dtype)


_TILE_SUPER_BYTES = {Q4_K: 2368, Q5_K: 2880, Q6_K: 3360, IQ4_XS: 2208}  # csrc/kquant_tiles.cpp


@torch.library.register_fake("quill::kquant_pack")
def _kquant_pack(weight, type, row_order=None) -> torch.Tensor:
    per_row = BLOCK_BYTES[type]
    groups = -(-weight.shape[0] // 64)  # of 4 tiles of 16 rows
    return weight.new_empty(groups, weight.shape[1] // per_row * 4 * _TILE_SUPER_BYTES[type])


@torch.library.register_fake("quill::kquant_tile_dequant")
def _kquant_tile_dequant(tiles, type, out_features, dtype, first=0, count=-1) -> torch.Tensor:
    k = tiles.shape[1] // (4 * _TILE_SUPER_BYTES[type]) * 256
    return tiles.new_empty(out_features - first if count < 0 else count, k, dtype=dtype)


@torch.library.register_fake("quill::kquant_tile_rows")
def _kquant_tile_rows(tiles, type, out_features, ids, dtype) -> torch.Tensor:
    k = tiles.shape[1] // (4 * _TILE_SUPER_BYTES[type]) * 256
    return tiles.new_empty(ids.numel(), k, dtype=dtype)


@torch.library.register_fake("quill::kquant_tile_linear")
def _kquant_tile_linear(x, tiles, type, out_features, bias=None, out_dtype=None) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features, dtype=out_dtype or x.dtype)
