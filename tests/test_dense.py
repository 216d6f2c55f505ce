"""The native float product (quill::dense_linear) against float64 matrix products.

The kernel multiplies the weight as stored (fp32, bf16 or fp16) by the activations in fp32
(bf16 pairs by vdpbf16ps, whose products are exact in fp32) and sums in fp32, so it is held to
fp32 rounding of those sums, then to the output dtype's one rounding.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.model.linear import Linear, MergedLinear, dense
from tests.conftest import NATIVE

needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")

# The default model's products: q/k/v merged, o, gate/up merged, down, the output head.
MODEL_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _check(x, weight, bias=None, out_dtype=None) -> None:
    got = torch.ops.quill.dense_linear(x, weight, bias, out_dtype)
    want = x.double() @ weight.double().T + (0 if bias is None else bias.double())
    assert got.dtype == (out_dtype or x.dtype) and got.shape == want.shape
    magnitude = x.double().abs() @ weight.double().abs().T
    eps = {torch.float32: 0.0, torch.bfloat16: 2**-8, torch.float16: 2**-11}[got.dtype]
    bound = 2e-6 * magnitude + eps * want.abs() * 1.01 + 1e-6
    error = (got.double() - want).abs()
    assert (error <= bound).all(), (
        f"max error {error.max():.3g}, bound there {bound.flatten()[error.argmax()]:.3g}"
    )


@needs_native
@pytest.mark.parametrize("shape", MODEL_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_native_model_shapes(shape, dtype):
    n, k = shape
    weight = (torch.randn(n, k) * 0.05).to(dtype)
    for rows in (1, 2, 8, 11):
        _check(torch.randn(rows, k).to(dtype), weight)


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 300),
    k=st.integers(1, 200),
    rows=st.integers(1, 64),
    w_dtype=st.sampled_from(DTYPES),
    x_dtype=st.sampled_from(DTYPES),
    out_dtype=st.sampled_from([None, *DTYPES]),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_random_shapes(n, k, rows, w_dtype, x_dtype, out_dtype, with_bias, seed):
    """Any K (the tails past a vector's width), rows past one pass of the kernel (8 or 4)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(w_dtype)
    x = (torch.randn(rows, k, generator=g) * 3).to(x_dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    _check(x, weight, bias, out_dtype)


@needs_native
def test_native_strided_rows():
    """Row slices (a merged weight's parts) and activation rows with a stride."""
    weight = torch.randn(96, 256).bfloat16()
    x = torch.randn(5, 300).bfloat16()
    _check(x[:, :128], weight[:, 64:192])
    _check(x[:, :256].float(), weight[10:50])


@needs_native
def test_native_dense_linear_passes_opcheck():
    args = (torch.randn(3, 64).bfloat16(), torch.randn(40, 64).bfloat16(), torch.randn(40), None)
    torch.library.opcheck(torch.ops.quill.dense_linear.default, args)


@needs_native
def test_native_refuses_bad_shapes():
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.quill.dense_linear(torch.randn(2, 96), torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="contiguous rows"):
        torch.ops.quill.dense_linear(torch.randn(2, 64), torch.randn(64, 8).T)
    with pytest.raises(RuntimeError, match="not supported"):
        torch.ops.quill.dense_linear(torch.randn(2, 64), torch.randn(8, 64).double())


@needs_native
def test_native_modules_equal_f_linear_in_rows():
    """`Linear` and `MergedLinear` run natively up to their row count and by F.linear above
    it; both give F.linear's products up to rounding, and the parts split the same way."""
    torch.manual_seed(0)
    merged = MergedLinear(64, [32, 16, 16], bias=True).bfloat16()
    plain = Linear(64, 48, bias=False).bfloat16()
    for m in (merged, plain):
        m.native_max_rows = 4
    for rows in (1, 4, 5):
        x = torch.randn(rows, 64).bfloat16()
        for got, want in zip(merged(x), [x @ w.T + b for w, b in _parts(merged)]):
            assert got.shape == want.shape
            torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
        torch.testing.assert_close(
            plain(x).float(), dense(x, plain.weight, None, 0).float(), atol=0.05, rtol=0.02
        )


def _parts(merged: MergedLinear):
    offset = 0
    for rows in merged.parts:
        yield merged.weight[offset : offset + rows], merged.bias[offset : offset + rows]
        offset += rows
