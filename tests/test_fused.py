"""The fused small ops (csrc/fused.cpp) against the PyTorch sequences they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.ops import fused
from tests.conftest import NATIVE

needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Rounding of one result in the dtype (the ops round where PyTorch does; only the order of a
# sum of squares differs, which moves the fp32 norm factor by an ulp or two).
ULP = {torch.float32: 1e-6, torch.bfloat16: 2**-7, torch.float16: 2**-10}  # relative, worst case


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    error = (got.double() - want.double()).abs()
    bound = 2 * ULP[got.dtype] * (want.double().abs() + 1e-3)  # one rounding flipped, times w
    assert (error <= bound).all(), f"max error {error.max():.3g}"


def _rand(*shape, dtype, seed):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)


@needs_native
@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 40),
    dim=st.sampled_from([64, 576, 960, 2048]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_native_rms_norm_and_residual_add(rows, dim, dtype, seed):
    x = _rand(rows, dim, dtype=dtype, seed=seed)
    weight = _rand(dim, dtype=dtype, seed=seed + 1)
    _close(torch.ops.quill.rms_norm(x, weight, 1e-5), fused.reference_rms_norm(x, weight, 1e-5))
    residual = _rand(rows, dim, dtype=dtype, seed=seed + 2)
    want_sum = residual + x
    want = fused.reference_rms_norm(want_sum, weight, 1e-5)
    got = torch.ops.quill.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(residual, want_sum)  # the sum rounds exactly as PyTorch's add
    _close(got, want)


@needs_native
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_native_rope_in_place_on_views_of_the_merged_projection(dtype, head_dim):
    tokens, heads, kv_heads = 7, 9, 3
    qkv = _rand(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype, seed=head_dim)
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, head_dim // 2) * 50
    cos = torch.cat([angles.cos()] * 2, -1).to(dtype)
    sin = torch.cat([angles.sin()] * 2, -1).to(dtype)
    want_q, want_k = fused.reference_rope(q, cos, sin), fused.reference_rope(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    torch.ops.quill.rope(q, k, cos, sin)
    # Each product and the sum round to the dtype as PyTorch's three operators do.
    assert torch.equal(q, want_q) and torch.equal(k, want_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)


@needs_native
@settings(max_examples=20, deadline=None)
@given(
    rows=st.integers(1, 20),
    dim=st.sampled_from([16, 256, 1536, 1552]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 1000),
)
def test_native_silu_mul_on_strided_halves(rows, dim, dtype, seed):
    gate_up = _rand(rows, 2 * dim, dtype=dtype, seed=seed) * 4
    gate, up = gate_up[:, :dim], gate_up[:, dim:]
    got = torch.ops.quill.silu_mul(gate, up)
    want = F.silu(gate) * up
    # silu's exp is quill's (2e-7 relative), then rounded to the dtype as PyTorch's is.
    error = (got.double() - want.double()).abs()
    bound = 2 * ULP[dtype] * want.double().abs() + 1e-6
    assert (error <= bound).all(), f"max error {error.max():.3g}"


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 70),
    n=st.integers(1, 300),
    ties=st.booleans(),
    specials=st.sampled_from(["none", "inf", "-inf", "nan"]),
    seed=st.integers(0, 2**16),
)
def test_native_argmax_equals_torch(rows, n, ties, specials, seed):
    """The first of equal maxima, every row -inf, NaN picked first: torch.argmax's choices."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if ties:
        x = x.round()  # many equal values, so equal maxima
    if specials != "none" and rows:
        value = float(specials)
        where = torch.rand(rows, n, generator=g) < 0.05
        x[where] = value
        x[0] = value if specials == "-inf" else x[0]
    assert torch.equal(torch.ops.quill.argmax_rows(x), x.argmax(dim=-1))


@needs_native
def test_native_argmax_model_vocabulary():
    x = torch.randn(64, 49152)
    x[3, 100] = x[3, 40000] = x[3].max() + 1  # a tie between two far-apart logits
    assert torch.equal(fused.argmax(x), x.argmax(dim=-1))
    assert torch.equal(fused.argmax(x[:, :1000]), x[:, :1000].argmax(dim=-1))  # strided rows


@needs_native
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 40),
    n=st.integers(1, 300),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    spread=st.sampled_from([0.1, 3.0, 40.0]),
    seed=st.integers(0, 2**16),
)
def test_native_score_rows_equals_torch(rows, n, dtype, spread, seed):
    """Each row's log-softmax at its target, the target's rank, the argmax and its log-softmax,
    as PyTorch computes them (logsumexp; 1 + the logits above it; torch.max), over row lengths
    with and without a vector tail; bf16 rows often hold equal maxima (the first is taken)."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, n, generator=g) * spread).to(dtype)
    targets = torch.randint(0, n, (rows,), generator=g)
    got = fused.RowScores(*torch.ops.quill.score_rows(x, targets))
    want = fused.score_reference(x, targets)
    assert got.logprob.dtype == got.best_logprob.dtype == torch.float32
    assert got.rank.dtype == got.best.dtype == torch.long
    tol = {"atol": 2e-6 * spread + 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(got.logprob, want.logprob, **tol)
    torch.testing.assert_close(got.best_logprob, want.best_logprob, **tol)
    assert torch.equal(got.rank, want.rank)
    assert torch.equal(got.best, want.best)


@needs_native
def test_native_score_rows_model_vocabulary_and_specials():
    x = _rand(8, 49152, dtype=torch.float32, seed=5) * 2.5
    x[1, :] = float("-inf")
    x[1, 7] = 0.0  # one possible token: logprob 0, rank 1
    x[2, 123] = float("nan")
    x[3, 9] = float("-inf")  # the target barred
    x[4, 49151] = 100.0  # the best in the last lane
    x[5, 40:43] = 100.0  # equal maxima: the first
    targets = torch.tensor([0, 7, 5, 9, 49151, 100, 2, 3])
    got = fused.score(x, targets)
    want = fused.score_reference(x, targets)
    ok = [0, 1, 3, 4, 5, 6, 7]
    # Against float64: the native sum of 49,152 exponentials runs in float32 lanes, whose
    # rounding grows about as the root of the terms a lane adds (a few ulps of the sum at most
    # here; torch's own float32 logsumexp differs by as much on some CPUs).
    exact = x[ok].double()
    lse = exact.logsumexp(dim=-1)
    tol = {"atol": 4 * 2**-24 * 49152**0.5, "rtol": 1e-6}
    want_logprob = exact.gather(1, targets[ok, None]).squeeze(1) - lse
    torch.testing.assert_close(got.logprob[ok].double(), want_logprob, **tol)
    torch.testing.assert_close(got.best_logprob[ok].double(), exact.max(-1).values - lse, **tol)
    assert got.logprob[1] == 0 and got.rank[1] == 1 and got.best[1] == 7
    assert got.best[4] == 49151 and got.rank[4] == 1 and got.best[5] == 40
    # A row holding NaN has no logprob; its best is its NaN, as torch.max says.
    assert torch.isnan(got.logprob[2]) and torch.isnan(got.best_logprob[2]) and got.best[2] == 123
    assert got.logprob[3] == float("-inf") and got.rank[3] == want.rank[3]
    assert torch.equal(got.rank[ok], want.rank[ok]) and torch.equal(got.best, want.best)
    # Strided rows (a view of the first 1000 logits) take the native path too.
    view = x[:, :1000]
    small = targets % 1000
    torch.testing.assert_close(
        fused.score(view, small).logprob[ok], fused.score_reference(view, small).logprob[ok]
    )


@needs_native
def test_native_fused_ops_pass_opcheck():
    x, residual, weight = torch.randn(3, 64), torch.randn(3, 64), torch.randn(64)
    torch.library.opcheck(torch.ops.quill.rms_norm.default, (x, weight, 1e-6))
    torch.library.opcheck(torch.ops.quill.add_rms_norm.default, (x, residual, weight, 1e-6))
    q, k = torch.randn(3, 4, 64), torch.randn(3, 2, 64)
    torch.library.opcheck(
        torch.ops.quill.rope.default, (q, k, torch.randn(3, 64), torch.randn(3, 64))
    )
    torch.library.opcheck(
        torch.ops.quill.silu_mul.default, (torch.randn(3, 32), torch.randn(3, 32))
    )
    torch.library.opcheck(torch.ops.quill.argmax_rows.default, (torch.randn(3, 50),))
    torch.library.opcheck(
        torch.ops.quill.score_rows.default, (torch.randn(3, 50), torch.tensor([0, 49, 7]))
    )


@needs_native
def test_native_fused_ops_refuse_bad_shapes():
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.quill.rms_norm(torch.randn(2, 64), torch.randn(32), 1e-6)
    with pytest.raises(RuntimeError, match="dtype"):
        torch.ops.quill.silu_mul(torch.randn(2, 32), torch.randn(2, 32).bfloat16())


def test_dispatch_falls_back_where_the_native_ops_do_not_apply():
    # A row length no kernel takes runs the PyTorch sequence, with the same result.
    x, weight = torch.randn(2, 20), torch.randn(20)
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-6), fused.reference_rms_norm(x, weight, 1e-6)
    )
    residual = torch.randn(2, 20)
    want = fused.reference_rms_norm(residual + x, weight, 1e-6)
    torch.testing.assert_close(fused.add_rms_norm(x, residual, weight, 1e-6), want)
