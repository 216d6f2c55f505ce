"""int8 weights in blocks of 32 (GGUF's Q8_0): quantizing, packing for the native kernel, and
the PyTorch code the kernel is checked against; the same for 4-bit (Q4_0, Q4_1) and 5-bit with
an offset (Q5_1) blocks.

A weight [N, K] becomes codes (int8, -127..127) and one fp16 scale per row and block of 32
inputs: w ~ code * scale. `pack` lays them out as csrc/qlinear.cpp reads them (tiles of 16
output rows, 4 inputs of each row side by side) and adds each block's code sum (the AVX-512
kernel's u8 offset is corrected by it). `reference_q8_linear` computes what the kernel computes,
activation quantization included, so a test can hold the kernel to float rounding; the
PyTorch fallback for serving multiplies by the dequantized weight instead.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill.ops import memory
from quill.ops.gguf_types import BLOCK32_BYTES, IQ4_NL, IQ4_VALUES, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0

BLOCK = 32
TILE = 16


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp weight [N, K] -> (codes int8 [N, K], scales fp16 [N, K/32]), as GGUF's Q8_0 does."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q8_0 needs in_features divisible by {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    codes = torch.round(blocks * inverse[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(n, k), scale.to(torch.float16)


@dataclass
class PackedQ8:
    """A Q8_0 weight in the native kernel's layout, its rows padded with zeros to tiles of 16
    (the kernel returns the padded rows; `out_features` says how many are real)."""

    codes: torch.Tensor  # int8 [N/16, K/4, 16, 4]
    scales: torch.Tensor  # fp16 [N/16, K/32, 16]
    sums: torch.Tensor  # int16 [N/16, K/32, 16]
    out_features: int

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * 4

    @property
    def padded_features(self) -> int:
        return self.codes.shape[0] * TILE

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes [N, K], scales [N, K/32]) back from the tiles."""
        padded, k = self.padded_features, self.in_features
        codes = self.codes.permute(0, 2, 1, 3).reshape(padded, k)
        scales = self.scales.permute(0, 2, 1).reshape(padded, k // BLOCK)
        return codes[: self.out_features], scales[: self.out_features]

    def dequantized(self) -> torch.Tensor:
        codes, scales = self.unpack()
        n, k = codes.shape
        blocks = codes.float().view(n, k // BLOCK, BLOCK) * scales.float()[..., None]
        return blocks.view(n, k)


def pack(codes: torch.Tensor, scales: torch.Tensor) -> PackedQ8:
    out_features, k = codes.shape
    if k % BLOCK:
        raise ValueError(f"packing needs in_features divisible by {BLOCK}, got {k}")
    pad = -out_features % TILE
    # -128 is never written by Q8_0's quantizer (round(x / (max|x| / 127))); the one-row kernel
    # negates codes (csrc/qlinear.cpp), which -128 would overflow, so it is read as -127.
    codes = codes.clamp(min=-127)
    if pad:  # (a copy of the whole weight: not made when the rows fill their tiles)
        codes = torch.nn.functional.pad(codes, (0, 0, 0, pad))
    scales = torch.nn.functional.pad(scales.to(torch.float16), (0, 0, 0, pad))
    n, blocks = out_features + pad, k // BLOCK
    tiled = codes.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)
    sums = codes.view(n, blocks, BLOCK).sum(-1, dtype=torch.int32).to(torch.int16)
    return PackedQ8(tiled.contiguous(), _per_tile(scales), _per_tile(sums), out_features)


def move_to_huge_pages(packs: list, arena_bytes: int = 256 << 20) -> None:
    """Put the codes of these weights (PackedQ8, PackedQ4), in order, on huge pages (CPU), in
    arenas of about `arena_bytes`.

    A step reads every weight once, a few hundred KB per product, and on this kind of VM a read
    on 4 KiB pages pays a two-level page walk per page: the products of a decode step ran
    4-15% faster with their codes on 2 MiB pages (quill/ops/memory.py). An arena's pages are
    all written when it is made, so one arena for a whole model held every code twice at once
    (a Q8_0 1B model's peak: 3.2 GB for 1.3 GB of codes); arena by arena, the codes moved are
    let go before the next is made.
    """
    packs = [p for p in packs if p.codes.device.type == "cpu"]
    start = 0
    while start < len(packs):
        end, total = start, 0
        while end < len(packs) and (
            end == start or total + packs[end].codes.numel() <= arena_bytes
        ):
            total += packs[end].codes.numel()
            end += 1
        arena = memory.zeros((total,), torch.uint8, torch.device("cpu"))
        offset = 0
        for p in packs[start:end]:
            n = p.codes.numel()
            codes = arena[offset : offset + n].view(p.codes.dtype).view(p.codes.shape)
            codes.copy_(p.codes)
            p.codes = codes
            offset += n
        memory.return_freed_memory()
        start = end


def quantize_activations(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (codes [M, K/block, block] as float, scales fp32 [M, K/block]), as the
    kernels do (blocks of 32 here; the K-quant kernels' super-blocks of 256)."""
    m, k = x.shape
    blocks = x.float().reshape(m, k // block, block)
    scale = blocks.abs().amax(-1) / 127
    inverse = torch.where(scale > 0, 1 / scale, torch.zeros_like(scale))
    return torch.round(blocks * inverse[..., None]), scale


def reference_q8_linear(
    x: torch.Tensor, packed: PackedQ8, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's arithmetic in float64: exact integer block products, scaled and summed."""
    codes, wscale = packed.unpack()
    n, k = codes.shape
    qa, ascale = quantize_activations(x)
    qw = codes.double().view(n, k // BLOCK, BLOCK)
    dots = torch.einsum("mbk,nbk->mnb", qa.double(), qw)
    scale = wscale.float()[None, :, :] * ascale[:, None, :]  # fp32, as the kernel's product
    y = (dots * scale.double()).sum(-1)
    return y if bias is None else y + bias.double()


def native_q8_linear(
    x: torch.Tensor,
    packed: PackedQ8,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The native kernel on x [M, K], its padded rows cut off (needs the native library)."""
    return _native(torch.ops.quill.q8_linear, x, packed, packed.sums, bias, out_dtype)


def _native(op, x, packed, third: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    padded = packed.padded_features
    if bias is not None and bias.numel() != padded:
        bias = torch.nn.functional.pad(bias, (0, padded - bias.numel()))
    y = op(x, packed.codes, packed.scales, third, bias, out_dtype)
    return y if y.shape[1] == packed.out_features else y[:, : packed.out_features]


# -- 4-bit: GGUF's Q4_1 (w = d * code + min) and Q4_0 (w = d * (code - 8)), as w = d * code + c.


def quantize_q4_1(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp weight [N, K] -> (codes uint8 0..15 [N, K], d fp16 [N, K/32], min fp16 [N, K/32]), as
    GGUF's Q4_1 does: d = (max - min) / 15, code = round((w - min) / d)."""
    n, k = weight.shape
    if k % BLOCK:
        raise ValueError(f"Q4_1 needs in_features divisible by {BLOCK}, got {k}")
    blocks = weight.detach().float().reshape(n, k // BLOCK, BLOCK)
    low, high = blocks.amin(-1), blocks.amax(-1)
    d = (high - low) / 15
    inverse = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    codes = torch.round((blocks - low[..., None]) * inverse[..., None]).clamp(0, 15)
    return codes.to(torch.uint8).reshape(n, k), d.to(torch.float16), low.to(torch.float16)


@dataclass
class PackedQ4:
    """4-bit codes in the native kernel's layout, rows padded to tiles of 16: w = d * code + c."""

    codes: torch.Tensor  # uint8 [N/16, K/32, 4, 16, 4], two codes a byte
    scales: torch.Tensor  # fp16 d [N/16, K/32, 16]
    offsets: torch.Tensor  # fp16 c [N/16, K/32, 16]
    out_features: int

    @property
    def in_features(self) -> int:
        return self.codes.shape[1] * BLOCK

    @property
    def padded_features(self) -> int:
        return self.codes.shape[0] * TILE

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K], d [N, K/32], c [N, K/32]) back from the tiles."""
        padded, k = self.padded_features, self.in_features
        low, high = self.codes & 0x0F, self.codes >> 4
        # [tile, block, step, row, i] x (low, high) -> [tile, row, block, step, half, i]
        both = torch.stack([low, high], dim=-2).permute(0, 3, 1, 2, 4, 5)
        codes = both.reshape(padded, k)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(padded, k // BLOCK)[: self.out_features]

        return codes[: self.out_features], rows(self.scales), rows(self.offsets)

    def dequantized(self) -> torch.Tensor:
        codes, d, c = self.unpack()
        n, k = codes.shape
        blocks = codes.float().view(n, k // BLOCK, BLOCK) * d.float()[..., None]
        return (blocks + c.float()[..., None]).view(n, k)


def pack_q4(codes: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> PackedQ4:
    """codes uint8 0..15 [N, K] and per-block d, c [N, K/32]: the kernel's layout."""
    out_features = codes.shape[0]
    codes, d, c = _padded_to_tiles(codes, d, c)
    n, k = codes.shape
    # [tile, row, block, step, half (low / high nibble), i] -> [tile, block, step, row, i]
    parts = codes.view(n // TILE, TILE, k // BLOCK, BLOCK // 8, 2, 4).permute(0, 2, 3, 1, 4, 5)
    packed = parts[..., 0, :] | (parts[..., 1, :] << 4)
    return PackedQ4(packed.contiguous(), _per_tile(d), _per_tile(c), out_features)


def _padded_to_tiles(codes: torch.Tensor, d: torch.Tensor, c: torch.Tensor):
    """codes [N, K] and per-block d, c [N, K/32] (fp16) with rows padded to tiles of 16."""
    k = codes.shape[1]
    if k % BLOCK:
        raise ValueError(f"packing needs in_features divisible by {BLOCK}, got {k}")
    pad = -codes.shape[0] % TILE

    def padded(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, 0, 0, pad))

    return padded(codes), padded(d.to(torch.float16)), padded(c.to(torch.float16))


def _per_tile(t: torch.Tensor) -> torch.Tensor:
    """Per-(row, block) values [N, K/32] -> the kernel's [N/16, K/32, 16]."""
    n, blocks = t.shape
    return t.view(n // TILE, TILE, blocks).permute(0, 2, 1).contiguous()


def reference_q4_linear(
    x: torch.Tensor, packed: PackedQ4 | PackedQ5, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The kernel's arithmetic in float64: d * a_scale * sum(code * qa) + c * a_scale * sum(qa)
    (Q4's and Q5's alike)."""
    codes, d, c = packed.unpack()
    n, k = codes.shape
    qa, ascale = quantize_activations(x)
    dots = torch.einsum("mbk,nbk->mnb", qa.double(), codes.double().view(n, k // BLOCK, BLOCK))
    scale = (d.float()[None, :, :] * ascale[:, None, :]).double()  # fp32, as the kernel's
    a_sums = (ascale.double() * qa.double().sum(-1))[:, None, :]
    y = (dots * scale + c.double()[None] * a_sums).sum(-1)
    return y if bias is None else y + bias.double()


def native_q4_linear(
    x: torch.Tensor,
    packed: PackedQ4,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return _native(torch.ops.quill.q4_linear, x, packed, packed.offsets, bias, out_dtype)


# -- 5-bit with an offset: GGUF's Q5_1 (w = d * code + min, codes 0..31), one code a byte.


@dataclass
class PackedQ5:
    """5-bit codes in the Q8 kernel's code layout with Q4's d and c: w = d * code + c."""

    codes: torch.Tensor  # uint8 [N/16, K/4, 16, 4], 0..31
    scales: torch.Tensor  # fp16 d [N/16, K/32, 16]
    offsets: torch.Tensor  # fp16 c [N/16, K/32, 16]
    out_features: int

    in_features = PackedQ8.in_features
    padded_features = PackedQ8.padded_features
    dequantized = PackedQ4.dequantized

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(codes [N, K], d [N, K/32], c [N, K/32]) back from the tiles."""
        padded, k = self.padded_features, self.in_features
        codes = self.codes.permute(0, 2, 1, 3).reshape(padded, k)

        def rows(t: torch.Tensor) -> torch.Tensor:
            return t.permute(0, 2, 1).reshape(padded, k // BLOCK)[: self.out_features]

        return codes[: self.out_features], rows(self.scales), rows(self.offsets)


def pack_q5(codes: torch.Tensor, d: torch.Tensor, c: torch.Tensor) -> PackedQ5:
    """codes uint8 0..31 [N, K] and per-block d, c [N, K/32]: the kernel's layout."""
    out_features = codes.shape[0]
    codes, d, c = _padded_to_tiles(codes, d, c)
    n, k = codes.shape
    tiled = codes.view(n // TILE, TILE, k // 4, 4).permute(0, 2, 1, 3)
    return PackedQ5(tiled.contiguous(), _per_tile(d), _per_tile(c), out_features)


def native_q5_linear(
    x: torch.Tensor,
    packed: PackedQ5,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    return _native(torch.ops.quill.q5_linear, x, packed, packed.offsets, bias, out_dtype)


# -- Rows of a GGUF table stored in blocks of 32 (an embedding looked up where it lies).


def block_codes(
    blocks: torch.Tensor, ggml_type: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Blocks of 32 as stored (uint8 [..., blocks, bytes]) -> (codes [..., blocks, 32], d fp16
    [..., blocks], c fp16 or None) with w = d * code (+ c): Q8_0 its int8 codes; Q5_0 its 5-bit
    codes less 16 and IQ4_NL its table's values, int8; Q4_1 codes 0..15 and Q5_1 codes 0..31
    with c their minimum, Q4_0 codes 0..15 with c = -8 d."""
    d = blocks[..., :2].contiguous().view(torch.float16)[..., 0]
    if ggml_type == Q8_0:
        return blocks[..., 2:].contiguous().view(torch.int8), d, None
    packed = blocks[..., {Q4_1: 4, Q5_0: 6, Q5_1: 8}.get(ggml_type, 2) :]
    # Byte j holds element j (low nibble) and element j + 16 (high) of its block.
    nibbles = torch.cat([packed & 0x0F, packed >> 4], -1)
    if ggml_type in (Q5_0, Q5_1):  # bit j of the uint32 before the nibbles: element j's fifth
        at = 2 if ggml_type == Q5_0 else 4
        high = blocks[..., at : at + 4].contiguous().view(torch.int32)
        bits = (high >> torch.arange(32, dtype=torch.int32)) & 1
        codes = nibbles.to(torch.int32) | (bits << 4)
        if ggml_type == Q5_1:
            return codes.to(torch.uint8), d, _minimum(blocks)
        return codes.sub(16).to(torch.int8), d, None
    if ggml_type == IQ4_NL:
        return torch.tensor(IQ4_VALUES, dtype=torch.int8)[nibbles.long()], d, None
    if ggml_type == Q4_1:
        return nibbles, d, _minimum(blocks)
    if ggml_type == Q4_0:
        return nibbles, d, (-8 * d.float()).half()
    raise ValueError(f"GGML type {ggml_type} is not a type of blocks of 32 read here")


def _minimum(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1's and Q5_1's fp16 minimum, after d."""
    return blocks[..., 2:4].contiguous().view(torch.float16)[..., 0]


def dequantize_rows(
    weight: torch.Tensor, ggml_type: int, ids: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """The rows `ids` of a tensor in blocks of 32 as the file stores it (uint8 [N, bytes per
    row]) -> [len(ids), K] in `dtype`: w = d * code (Q8_0, Q5_0 and IQ4_NL, `block_codes`),
    d * (code - 8) (Q4_0), d * code + m (Q4_1, Q5_1), computed in fp32 as the gguf package computes
    them."""
    rows = weight[ids.long()]
    blocks = rows.view(rows.shape[0], -1, BLOCK32_BYTES[ggml_type])
    codes, d, c = block_codes(blocks, ggml_type)
    d = d.float()[..., None]
    if ggml_type == Q4_0:
        w = d * (codes.float() - 8)
    elif ggml_type in (Q4_1, Q5_1):
        w = d * codes.float() + c.float()[..., None]
    else:
        w = d * codes.float()
    return w.reshape(rows.shape[0], -1).to(dtype)
