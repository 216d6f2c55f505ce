"""The Q8_0 product kernel against its PyTorch reference, and the packing it reads.

The reference (quill/ops/qlinear.py) quantizes the activations as the kernel does and sums the
exact integer block products in float64, so the kernel is held to fp32 rounding of its sums.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.ops import qlinear
from tests.conftest import NATIVE

needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")

# The default model's products: q/k/v merged, o, gate/up merged, down, the output head.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[:, :32] *= 8  # each row's first block larger than the rest: the scales differ
    return w


def _check(x: torch.Tensor, packed: qlinear.PackedQ8, bias=None, out_dtype=None) -> None:
    got = qlinear.native_q8_linear(x, packed, bias, out_dtype)
    want = qlinear.reference_q8_linear(x, packed, bias)
    assert got.dtype == (out_dtype or x.dtype)
    assert got.shape == want.shape
    # fp32 sums of up to K/32 block terms, then the output dtype's rounding.
    codes, wscale = packed.unpack()
    qa, ascale = qlinear.quantize_activations(x)
    k = codes.shape[1]
    magnitude = torch.einsum(
        "mbk,nbk->mnb", qa.double().abs(), codes.double().view(-1, k // 32, 32).abs()
    )
    magnitude = (magnitude * (wscale.double()[None] * ascale.double()[:, None])).sum(-1)
    eps = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[got.dtype]
    error = (got.double() - want).abs()
    bound = eps * (magnitude + want.abs()) + 1e-6
    assert (error <= bound).all(), (
        f"max error {error.max():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"
    )


def test_quantize_q8_0_round_trip():
    w = _weight(64, 96, 0)
    codes, scales = qlinear.quantize_q8_0(w)
    assert codes.dtype == torch.int8 and scales.dtype == torch.float16
    assert codes.abs().max() == 127
    packed = qlinear.pack(codes, scales)
    back_codes, back_scales = packed.unpack()
    assert torch.equal(back_codes, codes) and torch.equal(back_scales, scales)
    assert torch.equal(
        packed.sums.permute(0, 2, 1).reshape(64, 3), codes.view(64, 3, 32).sum(-1).short()
    )
    # Half a step of each block's scale (plus the scale's own fp16 rounding).
    err = (packed.dequantized() - w).abs().view(64, 3, 32)
    assert (err <= scales.float()[..., None] * 0.5 + w.abs().view(64, 3, 32) * 1e-3).all()


def test_pack_reads_a_code_of_minus_128_as_minus_127():
    """Q8_0's quantizer never writes -128; a file that does is read one step off there (the
    one-row kernel negates codes)."""
    codes = torch.full((16, 32), 5, dtype=torch.int8)
    codes[3, 7] = -128
    back, _ = qlinear.pack(codes, torch.ones(16, 1)).unpack()
    assert back[3, 7] == -127 and (back[codes != -128] == 5).all()


def test_pack_pads_rows_to_tiles_and_refuses_partial_blocks():
    w = torch.randn(24, 64)
    packed = qlinear.pack(*qlinear.quantize_q8_0(w))
    assert packed.codes.shape == (2, 16, 16, 4) and packed.out_features == 24
    assert torch.equal(packed.unpack()[0], qlinear.quantize_q8_0(w)[0])
    with pytest.raises(ValueError, match="divisible by 32"):
        qlinear.quantize_q8_0(torch.randn(16, 48))


@needs_native
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 8, 13])
def test_native_model_shapes(shape, rows):
    n, k = shape
    packed = qlinear.pack(*qlinear.quantize_q8_0(_weight(n, k, 1)))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    _check(x, packed)
    _check(x.bfloat16(), packed)


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 200),
    k_blocks=st.integers(1, 50),
    rows=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    out_dtype=st.sampled_from([None, torch.float32, torch.bfloat16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_random_shapes(n, k_blocks, rows, dtype, out_dtype, with_bias, seed):
    k = 32 * k_blocks
    g = torch.Generator().manual_seed(seed)
    packed = qlinear.pack(*qlinear.quantize_q8_0(torch.randn(n, k, generator=g)))
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block: scale 0, no division by it
    bias = torch.randn(n, generator=g) if with_bias else None
    _check(x, packed, bias, out_dtype)


def _check_q4(x, packed, bias=None, out_dtype=None) -> None:
    native = qlinear.native_q5_linear if isinstance(packed, qlinear.PackedQ5) else None
    got = (native or qlinear.native_q4_linear)(x, packed, bias, out_dtype)
    want = qlinear.reference_q4_linear(x, packed, bias)
    assert got.dtype == (out_dtype or x.dtype) and got.shape == want.shape
    codes, d, c = packed.unpack()
    qa, ascale = qlinear.quantize_activations(x)
    n, k = codes.shape
    terms = torch.einsum("mbk,nbk->mnb", qa.double().abs(), codes.double().view(n, k // 32, 32)) * (
        d.double().abs()[None] * ascale.double()[:, None]
    )
    terms = terms + c.double().abs()[None] * (ascale.double() * qa.double().abs().sum(-1))[:, None]
    magnitude = terms.sum(-1)
    eps = {torch.float32: 1e-5, torch.bfloat16: 8e-3, torch.float16: 1e-3}[got.dtype]
    error = (got.double() - want).abs()
    assert (error <= eps * (magnitude + want.abs()) + 1e-6).all(), f"max error {error.max():.3g}"


def test_q4_pack_round_trip_and_q4_0_form():
    w = _weight(40, 96, 5)
    codes, d, low = qlinear.quantize_q4_1(w)
    assert codes.max() <= 15 and codes.dtype == torch.uint8
    packed = qlinear.pack_q4(codes, d, low)
    back = packed.unpack()
    assert all(torch.equal(a, b) for a, b in zip(back, (codes, d, low)))
    # Half a step of each block, plus fp16 rounding of d and min.
    err = (packed.dequantized() - w).abs().view(40, 3, 32)
    assert (err <= d.float()[..., None] * 0.5 + 2e-3 * w.abs().max()).all()
    # Q4_0 (w = d * (code - 8)) is the same kernel with c = -8 d.
    q4_0 = qlinear.pack_q4(codes, d, -8 * d)
    want = (codes.float().view(40, 3, 32) - 8) * d.float()[..., None]
    torch.testing.assert_close(q4_0.dequantized(), want.view(40, 96), rtol=0, atol=0)


@needs_native
@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 200),
    k_blocks=st.integers(1, 50),
    rows=st.integers(1, 64),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
    five_bits=st.booleans(),
)
def test_native_q4_and_q5_random_shapes(n, k_blocks, rows, dtype, with_bias, seed, five_bits):
    """q4_linear on Q4_1 blocks, q5_linear on Q5_1 ones (the gguf package's quantizers)."""
    k = 32 * k_blocks
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    packed = _q5_1(w) if five_bits else qlinear.pack_q4(*qlinear.quantize_q4_1(w))
    x = (torch.randn(rows, k, generator=g) * 3).to(dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    _check_q4(x, packed, bias)


@needs_native
@pytest.mark.parametrize("shape", MODEL_SHAPES[:4])
def test_native_q4_model_shapes(shape):
    n, k = shape
    packed = qlinear.pack_q4(*qlinear.quantize_q4_1(_weight(n, k, 6)))
    for rows in (1, 2, 8, 11):
        _check_q4(torch.randn(rows, k).bfloat16(), packed)


@needs_native
def test_native_q4_linear_passes_opcheck():
    packed = qlinear.pack_q4(*qlinear.quantize_q4_1(_weight(32, 64, 7)))
    args = (torch.randn(3, 64), packed.codes, packed.scales, packed.offsets, None, None)
    torch.library.opcheck(torch.ops.quill.q4_linear.default, args)


def _q5_1(w: torch.Tensor) -> qlinear.PackedQ5:
    """`w` quantized by the gguf package's Q5_1 quantizer, its blocks decoded as the loader does."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    from quill.model.gguf_loader import decode_blocks

    return qlinear.pack_q5(*decode_blocks("Q5_1", quantize(w.numpy(), GGMLQuantizationType.Q5_1)))


def test_q5_pack_round_trip_equals_gguf():
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    from quill.model.gguf_loader import decode_blocks

    w = _weight(40, 96, 5)
    blocks = quantize(w.numpy(), GGMLQuantizationType.Q5_1)
    codes, d, c = decode_blocks("Q5_1", blocks)
    assert codes.dtype == torch.uint8 and codes.max() <= 31
    packed = qlinear.pack_q5(codes, d, c)
    assert all(torch.equal(a, b) for a, b in zip(packed.unpack(), (codes, d, c)))
    want = dequantize(blocks, GGMLQuantizationType.Q5_1)
    assert torch.equal(packed.dequantized(), torch.from_numpy(want))


@needs_native
def test_native_q5_linear_passes_opcheck():
    packed = _q5_1(_weight(32, 64, 7))
    args = (torch.randn(3, 64), packed.codes, packed.scales, packed.offsets, None, None)
    torch.library.opcheck(torch.ops.quill.q5_linear.default, args)


@needs_native
def test_native_rows_with_a_stride():
    packed = qlinear.pack(*qlinear.quantize_q8_0(_weight(64, 128, 2)))
    wide = torch.randn(5, 256)
    _check(wide[:, :128], packed)


@needs_native
def test_native_q8_linear_passes_opcheck():
    packed = qlinear.pack(*qlinear.quantize_q8_0(_weight(32, 64, 3)))
    x = torch.randn(3, 64)
    torch.library.opcheck(
        torch.ops.quill.q8_linear.default, (x, packed.codes, packed.scales, packed.sums, None, None)
    )


@needs_native
def test_native_refuses_bad_shapes():
    packed = qlinear.pack(*qlinear.quantize_q8_0(_weight(32, 64, 4)))
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.quill.q8_linear(torch.randn(2, 96), packed.codes, packed.scales, packed.sums)
    with pytest.raises(RuntimeError, match="scales must be contiguous Half"):
        torch.ops.quill.q8_linear(
            torch.randn(2, 64), packed.codes, packed.scales.float(), packed.sums
        )
