"""Fake (meta) kernels of the native ops: shapes and dtypes only, for torch.compile and opcheck.

Imported by `quill.ops.library.load` right after the library registers the ops.
"""

from __future__ import annotations

import torch


@torch.library.register_fake("quill::write_kv")
def _write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    return None


@torch.library.register_fake("quill::paged_attention")
def _paged_attention(
    q, k, v, k_cache, v_cache, slot_mapping, block_tables, seq_lens, query_start_loc, scale
) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


@torch.library.register_fake("quill::read_probe")
def _read_probe(buffer, num_threads, repeats, chunk_bytes=0) -> torch.Tensor:
    return buffer.new_empty(2, dtype=torch.float64)
