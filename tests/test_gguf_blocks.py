"""A GGUF file's Q8_0 and Q4_1 weights, loaded into int8 and int4 as stored (no re-quantization).

The file is written here by the `gguf` package's own writer and Q8_0 quantizer from the default
model's Q4_1 GGUF (every 2-D tensor re-encoded as Q8_0), so the reference is gguf's encoding:
quill must take its codes and scales bit for bit, and serve the same tokens as it does from the
dequantized floats re-quantized.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quill import LLM, SamplingParams
from quill.model.quant import QuantizedLinear, quantize_model
from quill.ops import qlinear
from tests.conftest import NATIVE, PROMPTS, load_in_fresh_process, rewrite_gguf


def _write_blocks(src, dst, kind: str = "Q8_0") -> None:
    """Every 2-D tensor of `src` whose rows fill blocks of 32 re-encoded in `kind` by gguf."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    def encode(name, data):
        if data.ndim == 2 and data.shape[1] % 32 == 0:
            ggml_type = GGMLQuantizationType[kind]
            return quantize(data, ggml_type), ggml_type
        return data, None

    rewrite_gguf(src, dst, encode)


@pytest.fixture(scope="module")
def q8_0_gguf(tmp_path_factory):
    from quill.model.default_model import default_gguf_path

    path = tmp_path_factory.mktemp("q8_0") / "smollm2-q8_0.gguf"
    _write_blocks(default_gguf_path(), path)
    return path


def _llm(path, quantization):
    return LLM(
        str(path), dtype="float32", kv_cache_dtype="float32", quantization=quantization,
        kv_cache_memory=64 << 20,
    )  # fmt: skip


@pytest.fixture(scope="module")
def direct_llm(q8_0_gguf):
    return _llm(q8_0_gguf, "int8")


@pytest.fixture(scope="module")
def float_llm(q8_0_gguf):
    return _llm(q8_0_gguf, "none")


def _file_blocks(path, name):
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    blocks = np.ascontiguousarray(tensor.data).reshape(tensor.data.shape[0], -1, 34)
    scales = blocks[..., :2].copy().view(np.float16)[..., 0]
    return blocks[..., 2:].copy().view(np.int8).reshape(tensor.data.shape[0], -1), scales


def test_int8_takes_the_files_blocks_as_stored(q8_0_gguf, direct_llm, float_llm):
    model = direct_llm.engine.runner.model
    # ffn_down of layer 0 is o = down_proj alone (no merge, no row permutation).
    codes, scales = model.layers[0].down_proj.q8.unpack()
    want_codes, want_scales = _file_blocks(q8_0_gguf, "blk.0.ffn_down.weight")
    assert torch.equal(codes, torch.from_numpy(want_codes))
    assert torch.equal(scales, torch.from_numpy(want_scales))
    # The tied output head is the embedding table's blocks.
    head_codes, _ = model.lm_head.q8.unpack()
    embd_codes, _ = _file_blocks(q8_0_gguf, "token_embd.weight")
    assert torch.equal(head_codes, torch.from_numpy(embd_codes))
    # q/k/v merged (q and k rows un-permuted as the float path does): the dequantized blocks
    # equal the float weights quill loaded from the same file.
    qkv = model.layers[3].qkv_proj
    assert isinstance(qkv, QuantizedLinear)
    float_qkv = float_llm.engine.runner.model.layers[3].qkv_proj.weight
    torch.testing.assert_close(qkv.dequantized(), float_qkv.float(), rtol=0, atol=0)


def test_direct_blocks_serve_what_requantized_floats_serve(q8_0_gguf, direct_llm):
    """Requantizing the dequantized floats recovers nearly every block (the scale comes back
    from max |w| / 127 up to fp32 rounding), so the two give the same greedy tokens."""
    direct = direct_llm
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    got = direct.generate(PROMPTS[:5], params, use_tqdm=False)
    requantized = _llm(q8_0_gguf, "none")
    model = requantized.engine.runner.model
    quantize_model(model, "int8", head=True)  # from the floats, not the file's blocks
    requantized_codes = model.layers[0].down_proj.q8.unpack()[0]
    direct_codes = direct.engine.runner.model.layers[0].down_proj.q8.unpack()[0]
    assert (requantized_codes == direct_codes).float().mean() > 0.99
    want = requantized.generate(PROMPTS[:5], params, use_tqdm=False)
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            top = max(lb, key=lb.get)
            assert abs(la[top] - lb[top]) < 0.02


def test_float_path_unchanged_by_q8_0_file(q8_0_gguf, float_llm):
    """quantization none ignores the blocks: the floats are the file's dequantized values."""
    weight = float_llm.engine.runner.model.layers[0].down_proj.weight
    codes, scales = _file_blocks(q8_0_gguf, "blk.0.ffn_down.weight")
    want = qlinear.PackedQ8(*_pack_parts(codes, scales))
    torch.testing.assert_close(weight.float(), want.dequantized(), rtol=0, atol=0)


def _pack_parts(codes, scales):
    packed = qlinear.pack(torch.from_numpy(codes), torch.from_numpy(scales))
    return packed.codes, packed.scales, packed.sums, packed.out_features


def _file_q4_1(path, name):
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    blocks = np.ascontiguousarray(tensor.data).reshape(tensor.data.shape[0], -1, 20)
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    qs = blocks[..., 4:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(tensor.data.shape[0], -1)
    return codes, d, m


def _first_token_gaps(llm, reference) -> list[float]:
    """Over PROMPTS, |logprob difference| of `reference`'s likeliest first token under `llm`,
    which must have it among its own five likeliest."""
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    gaps = []
    for got, want in zip(
        llm.generate(PROMPTS, params, use_tqdm=False),
        reference.generate(PROMPTS, params, use_tqdm=False),
    ):
        want_first, got_first = want.outputs[0].logprobs[0], got.outputs[0].logprobs[0]
        top = max(want_first, key=want_first.get)
        assert top in got_first
        gaps.append(abs(got_first[top] - want_first[top]))
    return gaps


def test_int4_takes_the_default_models_q4_1_blocks(caplog):
    """The default model's own GGUF is Q4_1: int4 serves its blocks exactly (the float path
    serves their dequantized values), so the two differ only by the activations' int8
    rounding, and stay within a small log-probability bound."""
    from quill.model.default_model import default_gguf_path

    path = default_gguf_path()
    caplog.set_level("INFO", logger="quill")
    int4 = _llm(path, "int4")
    # Its layers in Q4_1, its embedding table (the tied head, int8 here) in Q8_0.
    assert any(
        "as the GGUF file stores them (Q4_1, Q8_0)" in r.getMessage() for r in caplog.records
    )
    codes, d, c = int4.engine.runner.model.layers[0].down_proj.q4.unpack()
    want_codes, want_d, want_m = _file_q4_1(path, "blk.0.ffn_down.weight")
    assert torch.equal(codes, torch.from_numpy(want_codes.astype(np.uint8)))
    assert torch.equal(d, torch.from_numpy(want_d)) and torch.equal(c, torch.from_numpy(want_m))
    gaps = _first_token_gaps(int4, _llm(path, "none"))
    # Measured: at most 0.055 nats, mean ~0.02 (the activations' int8 rounding alone); int4
    # re-quantized from the floats moves ~0.1 on average (test_quant.py).
    assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.04, gaps


def test_int5_takes_q5_1_blocks_as_stored(tmp_path):
    """A Q5_1 file (the gguf package's quantizer over the default model): auto makes every
    layer product from the file's blocks alone (codes 0..31, d and minimum as stored), which
    serve within the activations' int8 rounding of the float path on the same file."""
    from quill.model.default_model import default_gguf_path
    from quill.model.gguf_loader import decode_blocks

    path = tmp_path / "smollm2-q5_1.gguf"
    _write_blocks(default_gguf_path(), path, "Q5_1")
    auto = _llm(path, "auto")
    model = auto.engine.runner.model
    products = [m for layer in model.layers for m in layer.modules()
                if isinstance(m, QuantizedLinear)]  # fmt: skip
    assert len(products) == 4 * len(model.layers)
    assert all(m.method == "int5" and m.float_weight is None for m in products)
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(path).tensors if t.name == "blk.0.ffn_down.weight")
    want = decode_blocks("Q5_1", tensor.data)
    assert all(torch.equal(a, b) for a, b in zip(model.layers[0].down_proj.q5.unpack(), want))
    gaps = _first_token_gaps(auto, _llm(path, "none"))
    # Measured: at most 0.087 nats, mean 0.029 (as int4 on Q4_1: the activations' rounding).
    assert max(gaps) < 0.1 and sum(gaps) / len(gaps) < 0.04, gaps


def test_auto_makes_the_blocks_the_weights_with_no_float_copy(q8_0_gguf, direct_llm):
    """quantization auto (the default) on a Q8_0 file: every layer product is made from the
    file's blocks alone (their float tensors never filled), so it serves what int8 serves."""
    auto = _llm(q8_0_gguf, "auto")
    model = auto.engine.runner.model
    layer_products = [m for layer in model.layers for m in layer.modules()
                      if isinstance(m, QuantizedLinear)]  # fmt: skip
    assert len(layer_products) == 4 * len(model.layers)  # qkv, o, gate_up, down
    assert all(m.float_weight is None and m.max_rows is None for m in layer_products)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    codes, scales = model.layers[0].down_proj.q8.unpack()
    want_codes, want_scales = _file_blocks(q8_0_gguf, "blk.0.ffn_down.weight")
    assert torch.equal(codes, torch.from_numpy(want_codes))
    assert torch.equal(scales, torch.from_numpy(want_scales))
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = auto.generate(PROMPTS[:4], params, use_tqdm=False)
    want = direct_llm.generate(PROMPTS[:4], params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "IQ4_NL"])
def test_table_rows_dequantize_as_gguf_does(kind):
    """A table in blocks of 32 is looked up where it lies: the rows read are dequantized bit for
    bit as the gguf package dequantizes them (random blocks, zero and extreme scales, every
    code)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from quill.ops.gguf_types import BLOCK32_BYTES, BLOCK32_TYPES

    ggml_type = BLOCK32_TYPES[kind]
    rng = np.random.default_rng(7)
    rows, blocks = 12, 6
    raw = rng.integers(0, 256, (rows, blocks, BLOCK32_BYTES[ggml_type]), dtype=np.uint8)
    scales = rng.normal(0, 0.05, (rows, blocks)).astype(np.float16)
    scales[0, 0], scales[1, 1], scales[2, 2] = 0, 65504, -65504  # zero and extreme scales
    raw[..., :2] = scales.view(np.uint8).reshape(rows, blocks, 2)
    with_min = kind in ("Q4_1", "Q5_1")
    if with_min:
        mins = rng.normal(0, 0.05, (rows, blocks)).astype(np.float16)
        mins[3, 3], mins[4, 4] = 65504, -65504
        raw[..., 2:4] = mins.view(np.uint8).reshape(rows, blocks, 2)
    codes = raw[3:, :, 4 if with_min else 2 :]
    codes[...] = (np.arange(codes.size) % 256).reshape(codes.shape)  # every byte of codes
    data = raw.reshape(rows, -1)
    ids = torch.tensor([5, 0, 3, 3, 11, 2, 1])
    got = qlinear.dequantize_rows(torch.from_numpy(data), ggml_type, ids, torch.float32)
    want = dequantize(data[ids.numpy()], GGMLQuantizationType[kind]).astype(np.float32)
    assert torch.equal(got, torch.from_numpy(want.reshape(len(ids), -1)))
    # The blocks as the loader decodes them for the int8 / int4 / int5 products: the same values.
    from quill.model.gguf_loader import decode_blocks

    decoded = decode_blocks(kind, data)
    if kind in ("Q8_0", "Q5_0", "IQ4_NL"):  # int8 blocks, exactly: codes x the file's d
        codes, d = decoded
        assert codes.dtype == torch.int8
        w = codes.float().reshape(rows, blocks, 32) * d.float()[..., None]
    else:
        codes, d, c = decoded
        w = codes.float().reshape(rows, blocks, 32) * d.float()[..., None] + c.float()[..., None]
    full = dequantize(data, GGMLQuantizationType[kind]).astype(np.float32).reshape(rows, blocks, 32)
    if kind == "Q4_0":  # d x code + (-8 d in fp16) against gguf's d x (code - 8): rounding
        # apart, and -8 d past fp16's range for the extreme scales (no file has them)
        fits = np.abs(scales) < 8192
        np.testing.assert_allclose(w.numpy()[fits], full[fits], rtol=1e-6, atol=1e-3)
    else:
        assert torch.equal(w, torch.from_numpy(full))


def test_auto_looks_the_q8_0_table_up_where_it_lies(q8_0_gguf, float_llm):
    """Under auto the Q8_0 embedding table is never made floats: lookups dequantize the rows
    they read from the file's map (equal to the float path's table), and the tied head is the
    table's blocks."""
    from quill.model.stored import StoredEmbedding

    auto = _llm(q8_0_gguf, "auto")
    model = auto.engine.runner.model
    assert isinstance(model.embed_tokens, StoredEmbedding)
    assert model.embed_tokens.table.type_name == "Q8_0"
    ids = torch.tensor([[0, 17, 49151], [3, 3, 1000]])
    table = float_llm.engine.runner.model.embed_tokens.weight
    torch.testing.assert_close(model.embed_tokens(ids), table[ids].float(), rtol=0, atol=0)
    head_codes, _ = model.lm_head.q8.unpack()
    embd_codes, _ = _file_blocks(q8_0_gguf, "token_embd.weight")
    assert torch.equal(head_codes, torch.from_numpy(embd_codes))
    # ... multiplied by the native kernel, never by a dequantized float copy of the table.
    assert model.lm_head.native == (NATIVE is not None)
    auto.generate([PROMPTS[0]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert model.lm_head._fallback is None or NATIVE is None


def test_a_q8_0_file_loads_in_about_its_own_size(q8_0_gguf):
    """RSS in a fresh process, against before loading: after loading, and at its peak while
    loading, at most the file's size, the floats quill makes (norms), the KV pool and 300 MB
    (measured 2026-12-06: the engine's working buffers take ~190 MB after the weights, for
    any model; the decoded blocks are one parameter's at a time)."""
    figures = load_in_fresh_process(q8_0_gguf)
    allowed = q8_0_gguf.stat().st_size + figures["floats"] + (8 << 20) + (300 << 20)
    assert figures["delta"] <= allowed and figures["peak"] <= allowed, (figures, allowed)
