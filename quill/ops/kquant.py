"""GGUF's K-quant weights (Q2_K to Q6_K, and IQ4_XS's super-blocks) as the file stores
them: the native product and lookup (csrc/kquant.cpp), and the PyTorch code they are checked
against and fall back to.

A weight is a uint8 tensor [out_features, bytes per row]: each row a run of super-blocks of 256
weights in ggml's layout (the kernel's header comment, and `dequantize` here, say how each
type packs them). Nothing is repacked: the tensor can be a view of the memory-mapped file.

`dequantize` is quill's own reading of the layouts, held bit for bit to the `gguf` package's
dequantizers (tests/test_kquant.py); `reference_linear` computes what the native kernel does,
activation quantization included (int8 per row and super-block, as llama.cpp's Q8_K), so the
kernel can be held to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from quill.ops import library
from quill.ops.gguf_types import (
    BLOCK_BYTES,
    FP16_FIELDS,
    IQ4_VALUES,
    IQ4_XS,
    NAMES,
    Q2_K,
    Q3_K,
    Q4_K,
    Q5_K,
    Q6_K,
    SUPER,
    TILE_TYPES,
    type_of,
)
from quill.ops.qlinear import quantize_activations

__all__ = [
    "BLOCK_BYTES",
    "FP16_FIELDS",
    "IQ4_XS",
    "NAMES",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
    "SUPER",
    "TILE_TYPES",
    "type_of",
]


def in_features(weight: torch.Tensor, ggml_type: int) -> int:
    return weight.shape[1] // BLOCK_BYTES[ggml_type] * SUPER


def _half(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes as fp16 -> fp32 [...]."""
    return b.contiguous().view(torch.float16).float().squeeze(-1)


def _half_word(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes as a little-endian uint16 -> int32 [...]."""
    b = b.int()
    return b[..., 0] | (b[..., 1] << 8)


def _scales_and_mins(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins (int32)."""
    q = q.int()
    lo, mid, top = q[..., 0:4], q[..., 4:8], q[..., 8:12]
    scales = torch.cat([lo & 63, (top & 15) | ((lo >> 6) << 4)], -1)
    mins = torch.cat([mid & 63, (top >> 4) | ((mid >> 6) << 4)], -1)
    return scales, mins


def dequantize(weight: torch.Tensor, ggml_type: int) -> torch.Tensor:
    """A K-quant weight [N, bytes per row] -> fp32 [N, K]."""
    n = weight.shape[0]
    blocks = weight.reshape(n, -1, BLOCK_BYTES[ggml_type])
    if ggml_type in (Q4_K, Q5_K):
        d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
        scales, mins = _scales_and_mins(blocks[..., 4:16])
        qs = blocks[..., 48:] if ggml_type == Q5_K else blocks[..., 16:]
        # 32-byte chunk c: low nibbles are sub-block 2c, high nibbles 2c + 1.
        chunks = qs.reshape(*qs.shape[:-1], 4, 1, 32).int()
        q = (chunks >> torch.tensor([0, 4], dtype=torch.int32).view(2, 1)) & 15
        q = q.reshape(*qs.shape[:-1], 8, 32)
        if ggml_type == Q5_K:  # bit j of byte l: sub-block j's fifth bit
            qh = blocks[..., 16:48].int().unsqueeze(-2)  # [.., 1, 32]
            q = q | (((qh >> torch.arange(8, dtype=torch.int32).view(8, 1)) & 1) << 4)
        w = (d[..., None] * scales.float())[..., None] * q.float()
        w = w - (dmin[..., None] * mins.float())[..., None]
    elif ggml_type == Q6_K:
        ql, qh = blocks[..., 0:128].int(), blocks[..., 128:192].int()
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        d = _half(blocks[..., 208:210])
        # Per half of 128: low nibbles of its 64 bytes are weights 0..63, high nibbles 64..127;
        # its 32 bytes of pairs give, at bits 0, 2, 4, 6, the top bits of groups of 32.
        low = ql.reshape(*ql.shape[:-1], 2, 1, 64)
        low = (low >> torch.tensor([0, 4], dtype=torch.int32).view(2, 1)) & 15
        low = low.reshape(*ql.shape[:-1], 2, 128)
        high = qh.reshape(*qh.shape[:-1], 2, 1, 32)
        high = (high >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(4, 1)) & 3
        high = high.reshape(*qh.shape[:-1], 2, 128)
        q = ((low | (high << 4)) - 32).reshape(*ql.shape[:-1], 16, 16).float()
        w = (d[..., None] * scales)[..., None] * q
    elif ggml_type == IQ4_XS:
        d = _half(blocks[..., 0:2])
        high = _half_word(blocks[..., 2:4])
        low = blocks[..., 4:8].int()
        # Sub-block j: 4 low bits from nibble j % 2 of byte j // 2, 2 high bits at 2j of `high`.
        low = ((low.unsqueeze(-1) >> torch.tensor([0, 4], dtype=torch.int32)) & 15).flatten(-2)
        high = (high.unsqueeze(-1) >> torch.arange(0, 16, 2, dtype=torch.int32)) & 3
        scales = (low | (high << 4)) - 32
        # Byte l of a sub-block's 16: weight l (low nibble) and 16 + l (high).
        qs = blocks[..., 8:].reshape(*blocks.shape[:-1], 8, 1, 16).int()
        q = ((qs >> torch.tensor([0, 4], dtype=torch.int32).view(2, 1)) & 15).flatten(-2)
        values = torch.tensor(IQ4_VALUES, dtype=torch.float32)[q.long()]
        w = (d[..., None] * scales.float())[..., None] * values
    elif ggml_type in (Q2_K, Q3_K):
        qs = blocks[..., 16:80] if ggml_type == Q2_K else blocks[..., 32:96]
        # Per half of 128: bits 2j of byte l (of 32) are weight 32j + l.
        low = qs.reshape(*qs.shape[:-1], 2, 1, 32).int()
        low = (low >> torch.tensor([0, 2, 4, 6], dtype=torch.int32).view(4, 1)) & 3
        low = low.reshape(*qs.shape[:-1], 16, 16)
        if ggml_type == Q2_K:
            packed = blocks[..., 0:16].int()
            d, dmin = _half(blocks[..., 80:82]), _half(blocks[..., 82:84])
            scale = d[..., None] * (packed & 15).float()
            mins = dmin[..., None] * (packed >> 4).float()
            w = scale[..., None] * low.float() - mins[..., None]
        else:
            # Bit i of byte l of the first 32 is weight 32i + l's third bit; clear: less 4.
            third = blocks[..., 0:32].int().unsqueeze(-2)
            third = (third >> torch.arange(8, dtype=torch.int32).view(8, 1)) & 1
            q = low - 4 * (1 - third.reshape(*qs.shape[:-1], 16, 16))
            # Sixteen 6-bit scales: low 4 bits of scale i in nibble i // 8 of byte i % 8, the top
            # 2 at bits 2 (i // 4) of byte 8 + i % 4; less 32.
            packed = blocks[..., 96:108].int()
            lo = (packed[..., 0:8].unsqueeze(-2) >> torch.tensor([0, 4]).view(2, 1)) & 15
            hi = (packed[..., 8:12].unsqueeze(-2) >> torch.tensor([0, 2, 4, 6]).view(4, 1)) & 3
            scales = (lo.flatten(-2) | (hi.flatten(-2) << 4)) - 32
            d = _half(blocks[..., 108:110])
            w = (d[..., None] * scales.float())[..., None] * q.float()
    else:
        raise ValueError(f"GGML type {ggml_type} is not a K-quant this module reads")
    return w.reshape(n, -1)


def reference_linear(
    x: torch.Tensor, weight: torch.Tensor, ggml_type: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """What the kernel computes, in float64: the activations quantized as it quantizes them,
    times the dequantized weight (its integer sums are exact, so only fp32 rounding differs)."""
    codes, scales = quantize_activations(x, SUPER)
    a = (codes * scales[..., None]).reshape(x.shape).double()
    out = a @ dequantize(weight, ggml_type).double().T
    return out if bias is None else out + bias.double()


def native_available(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and library.available()


def kquant_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    ggml_type: int,
    row_map: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    fallback: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T for a stored K-quant W, in x's dtype: by its `tiles` (W's rows repacked by
    quill::kquant_pack, in output order) when given, else W read in place; without the native
    kernel, by the float `fallback` (W dequantized) when given, else dequantized here."""
    if native_available(x):
        if tiles is not None:
            return torch.ops.quill.kquant_tile_linear(x, tiles, ggml_type, weight.shape[0], bias)
        return torch.ops.quill.kquant_linear(x, weight, ggml_type, row_map, bias)
    w = fallback if fallback is not None else dequantize(weight, ggml_type)
    out = F.linear(x, w.to(x.device, x.dtype), None if bias is None else bias.to(x.dtype))
    return placed_by(out, row_map)


def placed_by(out: torch.Tensor, row_map: torch.Tensor | None) -> torch.Tensor:
    """Outputs in a weight's file row order -> in output order (file row i is row_map[i])."""
    if row_map is None:
        return out
    placed = torch.empty_like(out)
    placed[..., row_map.long()] = out
    return placed


# Rows of weights dequantized at a time for a float product (`dequantized_linear`): small
# enough to stay in cache between the dequantization and the product, and to be reused memory
# (a whole projection of an 8B model, 117 MB in bf16, came as fresh pages at every call).
DEQUANTIZED_CHUNK_BYTES = 8 << 20


def dequantized_linear(
    x: torch.Tensor,
    tiles: torch.Tensor,
    ggml_type: int,
    out_features: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ W.T with W's tiles (quill::kquant_pack) dequantized to x's dtype a chunk of rows at a
    time, each multiplied by PyTorch's float product: for long steps on a machine where that
    product is faster than the integer tiles (AMX), as measured at load (quill/model/stored.py).
    """
    step = dequantized_chunk_rows(x)
    outs = []
    for first in range(0, out_features, step):
        count = min(step, out_features - first)
        w = torch.ops.quill.kquant_tile_dequant(
            tiles, ggml_type, out_features, x.dtype, first, count
        )
        outs.append(
            F.linear(x, w, None if bias is None else bias[first : first + count].to(x.dtype))
        )
    return outs[0] if len(outs) == 1 else torch.cat(outs, 1)


def dequantized_chunk_rows(x: torch.Tensor) -> int:
    return max(64, DEQUANTIZED_CHUNK_BYTES // (x.shape[1] * x.element_size()) // 64 * 64)


def dequantized_rows_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    ggml_type: int,
    row_map: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """`dequantized_linear` for a weight read where it lies (a type without tiles: Q2_K,
    Q3_K; Q6_K with AVX2): its rows dequantized a chunk at a time (quill::kquant_rows), in the
    file's order, the outputs then placed by `row_map` (file row i is output row row_map[i])."""
    n, step = weight.shape[0], dequantized_chunk_rows(x)
    outs = []
    for first in range(0, n, step):
        ids = torch.arange(first, min(n, first + step))
        w = torch.ops.quill.kquant_rows(weight, ggml_type, ids, x.dtype)
        outs.append(F.linear(x, w))
    out = placed_by(outs[0] if len(outs) == 1 else torch.cat(outs, 1), row_map)
    return out if bias is None else out + bias.to(out.dtype)


def kquant_rows(
    weight: torch.Tensor,
    ggml_type: int,
    ids: torch.Tensor,
    dtype: torch.dtype,
    tiles: torch.Tensor | None = None,
) -> torch.Tensor:
    """The rows `ids` of a stored K-quant weight, dequantized: [*ids.shape, K]; read from its
    `tiles` (quill::kquant_pack, rows in order) when given."""
    flat = ids.reshape(-1)
    if weight.device.type == "cpu" and library.available():
        if tiles is not None:
            out = torch.ops.quill.kquant_tile_rows(tiles, ggml_type, weight.shape[0], flat, dtype)
        else:
            out = torch.ops.quill.kquant_rows(weight, ggml_type, flat, dtype)
    else:
        out = dequantize(weight[flat.to(weight.device)], ggml_type).to(dtype)
    return out.reshape(*ids.shape, -1)
