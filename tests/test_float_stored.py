"""A GGUF file's float tensors (F32, F16, BF16) used where they lie (quill/model/stored.py's
float_linear): no float parameter is made for them, whatever dtype the model computes in.

The file is written here by the `gguf` package's writer from the mixed K-quant fixture's
dequantized values: layer 0 mixes F16, BF16 and F32 inside its merged q/k/v, layer 1 is BF16,
the embedding table (tied to the head) F16. The reference is transformers reading the same file
(its GGUF path dequantizes with the `gguf` package): in float32 the stored products are float
products with fp32 sums, so greedy tokens agree exactly and logprobs to float rounding.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quill import LLM, SamplingParams
from quill.model.stored import FLOAT_DTYPES, StoredEmbedding, StoredTensor
from quill.model.stored import float_linear as stored_float_linear
from quill.ops.gguf_types import BF16, F16, F32
from tests.conftest import NATIVE, load_in_fresh_process, rewrite_gguf
from tests.test_stored_weights import FIXTURE, PROMPTS, greedy

OPTIONS = dict(kv_cache_memory=32 << 20)


def _float_type(name: str):
    from gguf import GGMLQuantizationType as T

    if name.startswith("blk.1.") or "attn_k" in name:
        return T.BF16
    return T.F32 if "attn_v" in name else T.F16


def write_float_gguf(src, dst) -> None:
    from gguf import GGMLQuantizationType as T
    from gguf.quants import quantize

    def encode(name, data):
        kind = _float_type(name) if data.ndim == 2 else T.F32
        if kind == T.F32:
            return data, None
        if kind == T.F16:
            return data.astype(np.float16), None
        return quantize(data, kind), kind

    rewrite_gguf(src, dst, encode)


@pytest.fixture(scope="module")
def float_gguf(tmp_path_factory):
    path = tmp_path_factory.mktemp("floats") / "tiny-floats.gguf"
    write_float_gguf(FIXTURE, path)
    return path


@pytest.fixture(scope="module")
def reference(float_gguf):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(float_gguf.parent), gguf_file=float_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def fp32_llm(float_gguf):
    return LLM(str(float_gguf), dtype="float32", kv_cache_dtype="float32", **OPTIONS)


def _file_bytes(path, name) -> np.ndarray:
    from gguf import GGUFReader

    tensor = next(t for t in GGUFReader(path).tensors if t.name == name)
    return np.ascontiguousarray(tensor.data).view(np.uint8).reshape(tensor.data.shape[0], -1)


def test_float_tensors_are_read_where_they_lie(float_gguf, fp32_llm):
    model = fp32_llm.engine.runner.model
    # No float parameter but the norms: every product and the table are the file's tensors.
    assert all(p.dim() == 1 for p in model.parameters())
    assert isinstance(model.embed_tokens, StoredEmbedding)
    assert model.lm_head.segments == [model.embed_tokens.table]  # tied: the table is the head
    qkv = model.layers[0].qkv_proj
    assert [s.type_name for s in qkv.segments] == ["F16", "BF16", "F32"]
    assert [s.type_name for s in model.layers[1].gate_up_proj.segments] == ["BF16", "BF16"]
    # The bytes are the file's (q's rows stay in the file's permuted order: a row map).
    down = model.layers[0].down_proj.segments[0]
    assert np.array_equal(down.data.numpy(), _file_bytes(float_gguf, "blk.0.ffn_down.weight"))
    assert qkv.segments[0].row_map is not None
    assert np.array_equal(
        qkv.segments[0].data.numpy(), _file_bytes(float_gguf, "blk.0.attn_q.weight")
    )


def test_greedy_tokens_equal_transformers(fp32_llm, reference):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    for ids in PROMPTS:
        want = greedy(reference, ids, 16)
        out = fp32_llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
        assert list(out.token_ids) == want[len(ids) :]
        with torch.inference_mode():
            logits = reference(torch.tensor([want])).logits[0].log_softmax(-1)
        for pos, (token, scored) in enumerate(zip(out.token_ids, out.logprobs)):
            assert abs(scored[token] - logits[len(ids) + pos - 1, token].item()) < 1e-3


def test_no_float_copy_of_weights_already_in_the_dtype_computed_in(float_gguf):
    """bf16 arithmetic: layer 1's BF16 products are their own float weights (a copy would be
    the same values again), and long steps (above the row count measured at load; forced
    here) multiply by the view of the file."""
    llm = LLM(str(float_gguf), dtype="bfloat16", kv_cache_dtype="bfloat16", **OPTIONS)
    model = llm.engine.runner.model
    gate_up = model.layers[1].gate_up_proj
    assert gate_up.floats_only(torch.bfloat16) and gate_up.float_weight is None
    gate_up.dequantize_above = 0
    x = torch.randn(40, gate_up.in_features, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = gate_up(x)
    w = torch.cat([s.values for s in gate_up.segments])
    want = torch.nn.functional.linear(x, w)
    torch.testing.assert_close(torch.cat(got, -1), want, rtol=0, atol=0)
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _segment(ggml_type: int, rows: int, k: int, permuted: bool, seed: int) -> StoredTensor:
    g = torch.Generator().manual_seed(seed)
    values = (torch.randn(rows, k, generator=g) * 0.5).to(FLOAT_DTYPES[ggml_type])
    row_map = torch.randperm(rows, generator=g).int() if permuted else None
    return StoredTensor(values.view(torch.uint8), ggml_type, row_map)


@settings(max_examples=30, deadline=None)
@given(
    ggml_type=st.sampled_from([F32, F16, BF16]),
    rows=st.integers(1, 64),
    out_rows=st.integers(1, 80),
    k=st.sampled_from([16, 64, 200]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    permuted=st.booleans(),
    biased=st.booleans(),
    native=st.booleans() if NATIVE is not None else st.just(False),
    gemm=st.booleans(),
    seed=st.integers(0, 1000),
)
def test_float_product_against_float64(
    ggml_type, rows, out_rows, k, dtype, permuted, biased, native, gemm, seed
):
    """Each float type's product, natively (quill::dense_linear) or by PyTorch's (the view, or
    chunks converted), rows placed by the row map: the float64 product of the file's values
    within the rounding of the activations' dtype."""
    s = _segment(ggml_type, out_rows, k, permuted, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(rows, k, generator=g).to(dtype)
    bias = torch.randn(out_rows, generator=g) if biased else None
    with torch.inference_mode():
        got = stored_float_linear(x, s, bias, native, gemm).double()
    w = s.values.double()
    if permuted:  # file row i is output row row_map[i]
        placed = torch.empty_like(w)
        placed[s.row_map.long()] = w
        w = placed
    want = x.double() @ w.T + (0 if bias is None else bias.double())
    magnitude = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    eps = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16 output: 8 bits of mantissa
    assert ((got - want).abs() <= eps * magnitude + 1e-6).all()


def test_a_float_file_loads_in_about_its_own_size(float_gguf):
    """RSS after loading in a fresh process: the file, the norms, what float copies for long
    steps quill keeps (fp32 copies of the 16-bit tensors at most), the KV pool and 150 MB."""
    figures = load_in_fresh_process(float_gguf)
    size = float_gguf.stat().st_size
    allowed = size + 2 * size + figures["floats"] + (8 << 20) + (150 << 20)
    assert figures["delta"] <= allowed, figures
    assert figures["floats"] < 1 << 20  # the norms alone
