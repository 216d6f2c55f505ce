"""GGUF's K-quants and IQ4_XS as stored (quill/ops/kquant.py, csrc/kquant.cpp), against the `gguf`
package's numpy dequantizers (llama.cpp's own, tested bit for bit against its C code).

Random super-blocks (every byte random: every code, scale and min; the fp16 d and dmin set to
finite values including 0, tiny, negative and fp16's largest) are dequantized by quill's
PyTorch reading and looked up by the native kernel, both bit for bit equal to gguf's. The
native product is held to the PyTorch model of what it computes (activations quantized to
int8 per row and super-block) within float rounding, and to the exact float64 product of
the dequantized weights within the bound that activation quantization allows, worked out per
output here: sum over super-blocks of (max |a| / 254) x sum |w|.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quill.ops import kquant
from tests.conftest import NATIVE

needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")
TYPES = sorted(kquant.NAMES)
TILE_TYPES = sorted(kquant.TILE_TYPES)
EDGE_HALVES = [0.0, 6e-8, -3e-3, 1e-2, 0.5, 65504.0]


def random_weight(ggml_type: int, rows: int, supers: int, seed: int, edge: bool = False):
    """uint8 [rows, bytes per row] of random super-blocks with finite fp16 fields."""
    rng = np.random.default_rng(seed)
    size = kquant.BLOCK_BYTES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, supers, size), dtype=np.uint8)
    for at in kquant.FP16_FIELDS[ggml_type]:
        if edge:
            values = rng.choice(np.array(EDGE_HALVES, dtype=np.float16), size=(rows, supers))
        else:
            values = (rng.standard_normal((rows, supers)) * 0.01).astype(np.float16)
        raw[..., at : at + 2] = values.view(np.uint8).reshape(rows, supers, 2)
    return torch.from_numpy(raw.reshape(rows, supers * size))


def gguf_dequantized(weight: torch.Tensor, ggml_type: int) -> np.ndarray:
    return quants.dequantize(weight.numpy(), GGMLQuantizationType(ggml_type))


@pytest.mark.parametrize("ggml_type", TYPES, ids=kquant.NAMES.get)
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge values"])
def test_dequantize_is_ggufs_bit_for_bit(ggml_type, edge):
    weight = random_weight(ggml_type, 7, 5, seed=ggml_type, edge=edge)
    expected = gguf_dequantized(weight, ggml_type)
    ours = kquant.dequantize(weight, ggml_type).numpy()
    assert ours.shape == expected.shape == (7, 5 * 256)
    np.testing.assert_array_equal(ours, expected)


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES, ids=kquant.NAMES.get)
@pytest.mark.parametrize("edge", [False, True], ids=["random", "edge values"])
def test_native_rows_are_ggufs_bit_for_bit(ggml_type, edge):
    weight = random_weight(ggml_type, 9, 3, seed=10 + ggml_type, edge=edge)
    expected = gguf_dequantized(weight, ggml_type)
    ids = torch.tensor([8, 0, 3, 3, 7])
    rows = torch.ops.quill.kquant_rows(weight, ggml_type, ids, torch.float32)
    np.testing.assert_array_equal(rows.numpy(), expected[ids.numpy()])
    bf16 = kquant.kquant_rows(weight, ggml_type, ids.view(1, 5), torch.bfloat16)
    assert bf16.shape == (1, 5, 768) and bf16.dtype == torch.bfloat16
    assert torch.equal(bf16[0], torch.from_numpy(expected[ids.numpy()]).bfloat16())
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.quill.kquant_rows(weight, ggml_type, torch.tensor([9]), torch.float32)


def activation_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per output, the most activation quantization can move it: per super-block, each
    activation moves by at most half a step (max |a| / 254) against |w|."""
    m, k = x.shape
    step = x.double().reshape(m, k // 256, 256).abs().amax(-1) / 254  # [M, S]
    w_abs = w.double().abs().reshape(w.shape[0], k // 256, 256).sum(-1)  # [N, S]
    return step @ w_abs.T


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ggml_type=st.sampled_from(TYPES),
    rows=st.integers(1, 64),
    n=st.integers(1, 40),
    supers=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    strided=st.booleans(),
    extras=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_native_product_matches_the_references(
    ggml_type, rows, n, supers, dtype, strided, extras, seed
):
    weight = random_weight(ggml_type, n, supers, seed)
    k = supers * 256
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randn(rows, k + (16 if strided else 0), generator=gen).to(dtype)
    x = wide[:, :k]  # rows strided past their length
    bias = torch.randn(n, generator=gen) if extras else None
    row_map = torch.randperm(n, generator=gen).int() if extras else None
    out = torch.ops.quill.kquant_linear(x, weight, ggml_type, row_map, bias, torch.float32)
    if row_map is not None:  # back to the weight's own row order
        out = out[:, row_map.long()]
    modelled = kquant.reference_linear(x, weight, ggml_type, bias)
    w = kquant.dequantize(weight, ggml_type)
    magnitude = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.abs())
    assert ((out.double() - modelled).abs() <= 2e-6 * magnitude + 1e-6).all()
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert ((out.double() - exact).abs() <= activation_bound(x, w) + 2e-6 * magnitude + 1e-6).all()


@needs_native
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ggml_type=st.sampled_from(TILE_TYPES),
    rows=st.integers(1, 130),  # past the activation quantizer's parallel grain (csrc/kquant.h)
    n=st.integers(1, 150),  # partial tiles (16 rows) and groups of tiles (64)
    supers=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    reorder=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiled_product_matches_the_references(ggml_type, rows, n, supers, dtype, reorder, seed):
    """quill::kquant_pack moves the file's values into tiles (rows in `row_order`, the output
    order); quill::kquant_tile_linear over them is the same product."""
    weight = random_weight(ggml_type, n, supers, seed)
    gen = torch.Generator().manual_seed(seed)
    order = torch.randperm(n, generator=gen) if reorder else None
    tiles = torch.ops.quill.kquant_pack(weight, ggml_type, order)
    x = torch.randn(rows, supers * 256, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen) if reorder else None
    out = torch.ops.quill.kquant_tile_linear(x, tiles, ggml_type, n, bias, torch.float32)
    in_order = weight if order is None else weight[order]
    modelled = kquant.reference_linear(x, in_order, ggml_type, bias)
    w = kquant.dequantize(in_order, ggml_type)
    magnitude = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.abs())
    assert ((out.double() - modelled).abs() <= 2e-6 * magnitude + 1e-6).all()


@needs_native
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ggml_type=st.sampled_from(TILE_TYPES),
    n=st.integers(1, 150),
    supers=st.integers(1, 3),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
    edge=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_tiles_dequantize_to_the_files_values_bit_for_bit(ggml_type, n, supers, dtype, edge, seed):
    """quill::kquant_tile_dequant gives back, from the tiles, the file's values (gguf's
    dequantizer, in the tiles' row order) rounded once to the dtype; whole or a chunk of rows."""
    weight = random_weight(ggml_type, n, supers, seed, edge=edge)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    tiles = torch.ops.quill.kquant_pack(weight, ggml_type, order)
    expected = torch.from_numpy(gguf_dequantized(weight, ggml_type))[order].to(dtype)
    whole = torch.ops.quill.kquant_tile_dequant(tiles, ggml_type, n, dtype)
    assert whole.dtype == dtype and torch.equal(whole, expected)
    first = 16 * (seed % (1 + (n - 1) // 16))
    count = (seed // 7) % (n - first + 1)
    chunk = torch.ops.quill.kquant_tile_dequant(tiles, ggml_type, n, dtype, first, count)
    assert torch.equal(chunk, expected[first : first + count])
    # Single rows (an embedding table kept in tiles), any order, repeated.
    ids = torch.randint(0, n, (7,), generator=torch.Generator().manual_seed(seed))
    rows = kquant.kquant_rows(weight[order], ggml_type, ids.view(1, 7), dtype, tiles)
    assert rows.shape == (1, 7, supers * 256) and torch.equal(rows[0], expected[ids])
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.quill.kquant_tile_rows(tiles, ggml_type, n, torch.tensor([n]), dtype)


@needs_native
@pytest.mark.parametrize("ggml_type", TILE_TYPES, ids=kquant.NAMES.get)
def test_dequantized_product_is_the_float_product(ggml_type, monkeypatch):
    """kquant.dequantized_linear (long steps where the float product measures faster) is x
    times the file's values, a chunk of rows at a time (a small chunk here: several), bias
    included: float32 against float64."""
    monkeypatch.setattr(kquant, "DEQUANTIZED_CHUNK_BYTES", 64 * 512 * 4)
    weight = random_weight(ggml_type, 150, 2, seed=ggml_type)
    tiles = torch.ops.quill.kquant_pack(weight, ggml_type, None)
    x, bias = torch.randn(33, 512), torch.randn(150)
    out = kquant.dequantized_linear(x, tiles, ggml_type, 150, bias)
    w = torch.from_numpy(gguf_dequantized(weight, ggml_type)).double()
    exact = x.double() @ w.T + bias.double()
    magnitude = x.double().abs() @ w.abs().T + bias.double().abs()
    assert out.shape == (33, 150)
    assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()
    with pytest.raises(RuntimeError, match="whole tiles"):
        torch.ops.quill.kquant_tile_dequant(tiles, ggml_type, 150, torch.float32, 8, 16)


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES, ids=kquant.NAMES.get)
def test_dequantized_rows_product_is_the_float_product(ggml_type, monkeypatch):
    """kquant.dequantized_rows_linear (long steps of a weight kept where it lies) is x times
    the file's values, rows dequantized a chunk at a time in the file's order and the outputs
    placed by the row map, bias included: float32 against float64."""
    monkeypatch.setattr(kquant, "DEQUANTIZED_CHUNK_BYTES", 64 * 512 * 4)
    weight = random_weight(ggml_type, 150, 2, seed=ggml_type)
    gen = torch.Generator().manual_seed(ggml_type)
    x, bias = torch.randn(33, 512, generator=gen), torch.randn(150, generator=gen)
    row_map = torch.randperm(150, generator=gen).int()
    out = kquant.dequantized_rows_linear(x, weight, ggml_type, row_map, bias)
    w = torch.from_numpy(gguf_dequantized(weight, ggml_type)).double()
    placed = torch.empty_like(w)
    placed[row_map.long()] = w
    exact = x.double() @ placed.T + bias.double()
    magnitude = x.double().abs() @ placed.abs().T + bias.double().abs()
    assert out.shape == (33, 150)
    assert ((out.double() - exact).abs() <= 1e-5 * magnitude + 1e-6).all()


@needs_native
def test_tiles_check_their_inputs():
    weight = random_weight(kquant.Q4_K, 20, 2, seed=4)
    tiles = torch.ops.quill.kquant_pack(weight, kquant.Q4_K, None)
    x = torch.randn(2, 512)
    with pytest.raises(RuntimeError, match="not a type kept in tiles"):
        torch.ops.quill.kquant_pack(weight, 8, None)
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.quill.kquant_tile_linear(torch.randn(2, 256), tiles, kquant.Q4_K, 20, None)
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.quill.kquant_tile_linear(x, tiles, kquant.Q4_K, 80, None)
    out = torch.ops.quill.kquant_tile_linear(x, tiles, kquant.Q4_K, 20, None, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 20)


@needs_native
def test_native_product_in_every_output_dtype_and_errors():
    weight = random_weight(kquant.Q4_K, 5, 2, seed=3)
    x = torch.randn(3, 512)
    full = torch.ops.quill.kquant_linear(x, weight, kquant.Q4_K, None, None, torch.float32)
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.ops.quill.kquant_linear(x, weight, kquant.Q4_K, None, None, dtype)
        assert out.dtype == dtype and torch.equal(out, full.to(dtype))
    with pytest.raises(RuntimeError, match="not Q2_K"):
        torch.ops.quill.kquant_linear(x, weight, 8, None, None)
    with pytest.raises(RuntimeError, match="inputs"):
        torch.ops.quill.kquant_linear(torch.randn(3, 256), weight, kquant.Q4_K, None, None)
    assert torch.ops.quill.kquant_linear(x[:0], weight, kquant.Q4_K, None, None).shape == (0, 5)


@needs_native
@pytest.mark.parametrize("ggml_type", TYPES, ids=kquant.NAMES.get)
def test_native_ops_pass_opcheck(ggml_type):
    weight = random_weight(ggml_type, 6, 2, seed=5)
    x = torch.randn(3, 512)
    bias = torch.randn(6)
    row_map = torch.tensor([5, 4, 3, 2, 1, 0], dtype=torch.int32)
    torch.library.opcheck(
        torch.ops.quill.kquant_linear.default, (x, weight, ggml_type, row_map, bias, None)
    )
    ids = torch.tensor([1, 5])
    torch.library.opcheck(
        torch.ops.quill.kquant_rows.default, (weight, ggml_type, ids, torch.float32)
    )
    order = torch.tensor([5, 4, 3, 2, 1, 0])
    if ggml_type not in kquant.TILE_TYPES:
        with pytest.raises(RuntimeError, match="not a type kept in tiles"):
            torch.ops.quill.kquant_pack(weight, ggml_type, order)
        return
    torch.library.opcheck(torch.ops.quill.kquant_pack.default, (weight, ggml_type, order))
    tiles = torch.ops.quill.kquant_pack(weight, ggml_type, order)
    torch.library.opcheck(
        torch.ops.quill.kquant_tile_linear.default, (x, tiles, ggml_type, 6, bias, None)
    )
    torch.library.opcheck(
        torch.ops.quill.kquant_tile_dequant.default, (tiles, ggml_type, 6, torch.bfloat16, 0, 5)
    )
    torch.library.opcheck(
        torch.ops.quill.kquant_tile_rows.default, (tiles, ggml_type, 6, ids, torch.float32)
    )


def test_the_pytorch_path_places_rows_and_adds_bias(monkeypatch):
    """Without the native kernel (a GPU, a CPU without a library): the dequantized weight."""
    monkeypatch.setattr(kquant, "native_available", lambda x: False)
    weight = random_weight(kquant.Q6_K, 4, 1, seed=8)
    x = torch.randn(2, 256)
    bias = torch.randn(4)
    row_map = torch.tensor([2, 0, 3, 1], dtype=torch.int32)
    w = kquant.dequantize(weight, kquant.Q6_K)
    out = kquant.kquant_linear(x, weight, kquant.Q6_K, row_map, bias, fallback=w.clone())
    want = torch.empty(2, 4)
    want[:, row_map.long()] = x @ w.T + bias
    torch.testing.assert_close(out, want)
