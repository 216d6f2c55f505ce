"""GGUF weights used where they lie (quill/model/stored.py): a tiny Llama quantized by
llama.cpp's own quantizer into a mix of types (tests/fixtures/make_kquant_fixture.py: Q4_K,
Q5_K and Q6_K inside one merged projection, IQ4_XS beside Q2_K in another, Q3_K, a Q4_K table
tied to the head, Q8_0 and Q5_0 beside them), against transformers reading the same file.

The stored products quantize their activations to int8 per row and 256 values, as llama.cpp
does, so their logits are not a float evaluation's: the model is held (1) to the same model
with every stored product computed by the PyTorch model of the kernel (activations quantized
alike, float64 sums) product by product, within float rounding, which checks the whole path
(tiles, row maps, merged types, the tied table as head); and (2) to transformers' float
evaluation of the file, teacher-forced, within the bound that activation quantization leaves
on these logits, and
with the same greedy choice wherever transformers' top two are further apart than twice it.
With quantization="none" the file's tensors are dequantized at load and greedy tokens equal
transformers' exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from quill import LLM, SamplingParams
from quill.model.quant import QuantizedLinear
from quill.model.stored import StoredEmbedding, StoredLinear, tiled_types
from quill.ops import kquant
from tests.conftest import NATIVE, load_in_fresh_process

FIXTURE = Path(__file__).parent / "fixtures" / "tiny-kquant.gguf"
PROMPTS = [[1, 504, 8870, 2056], list(range(300, 360)), [7, 9]]
# Teacher-forced logprob distance to transformers' float logits, which activation quantization
# (int8 per 256 values, as llama.cpp's) moves: on this random model, whose logits span tens of
# nats, measured at most 1.93 and 0.23 on average over the 48 tokens (the 2- and 3-bit tensors
# amplify it: at most 0.77 before them). Greedy choices must agree wherever transformers' top
# two are further apart than GAP (8 such choices here).
BOUND, MEAN_BOUND, GAP = 2.5, 0.4, 1.6
needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")
OPTIONS = dict(dtype="float32", kv_cache_dtype="float32", kv_cache_memory=32 << 20)


@pytest.fixture(scope="module")
def reference():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(FIXTURE.parent), gguf_file=FIXTURE.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def stored_llm():
    llm = LLM(str(FIXTURE), **OPTIONS)
    # The stored path alone: no float copies for large steps (tested on their own below).
    for m in llm.engine.runner.model.modules():
        if isinstance(m, StoredLinear):
            m.float_weight = m.max_rows = None
    return llm


def test_float_copies_are_the_files_values_and_serve_large_steps(stored_llm):
    """A stored product's float copy (kept for large steps where measured faster) is the file's
    tensor dequantized, rows in place, as the float path loads it; with a copy, steps above
    max_rows multiply by it and smaller ones read the stored rows; no budget, no copy."""
    from quill.model.stored_timing import keep_float_copies

    floats = LLM(str(FIXTURE), **{**OPTIONS, "quantization": "none"}).engine.runner.model
    model = stored_llm.engine.runner.model
    stored = {n: m for n, m in model.named_modules() if isinstance(m, StoredLinear)}
    assert stored
    for name, m in stored.items():
        tied = name == "lm_head" and floats.lm_head is None  # the table is the head
        want = floats.embed_tokens.weight if tied else floats.get_submodule(name).weight
        assert torch.equal(m.dequantized(torch.float32), want), name
    assert keep_float_copies(model, torch.float32, budget=0) == (-1, 0)
    assert all(m.float_weight is None for m in stored.values())
    try:
        for m in stored.values():
            m.float_weight, m.max_rows = m.dequantized(torch.float32), 4
        m = model.layers[0].down_proj
        large, small = torch.randn(5, m.in_features), torch.randn(4, m.in_features)
        assert torch.equal(m(large), torch.nn.functional.linear(large, m.float_weight))
        m.float_weight = torch.zeros_like(m.float_weight)  # the small step must not read it
        assert m(small).abs().sum() > 0
    finally:
        for m in stored.values():
            m.float_weight = m.max_rows = None


def greedy(reference, ids: list[int], n: int) -> list[int]:
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = reference.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0].tolist()


def test_the_k_quant_tensors_are_used_as_stored(stored_llm):
    model = stored_llm.engine.runner.model
    assert isinstance(model.embed_tokens, StoredEmbedding)
    assert isinstance(model.lm_head, StoredLinear)  # the tied table, as the head
    qkv = model.layers[0].qkv_proj
    assert isinstance(qkv, StoredLinear)
    assert [s.type_name for s in qkv.segments] == ["Q4_K", "Q5_K", "Q6_K"]
    assert all(isinstance(model.layers[0].get_submodule(n), StoredLinear)
               for n in ("o_proj", "gate_up_proj", "down_proj"))  # fmt: skip
    gate_up = model.layers[1].gate_up_proj
    assert isinstance(gate_up, StoredLinear)
    assert [s.type_name for s in gate_up.segments] == ["Q2_K", "IQ4_XS"]
    assert model.layers[0].down_proj.segments[0].type_name == "Q3_K"
    assert isinstance(model.layers[1].o_proj, StoredLinear)
    assert not isinstance(model.layers[1].qkv_proj, StoredLinear)  # Q8_0: quill's int8 path
    # Q5_0: int8 blocks made from the file's, exactly (codes less 16, the same scales).
    down = model.layers[1].down_proj
    assert isinstance(down, QuantizedLinear) and down.method == "int8"
    # No float copy of any stored tensor: the model's own parameters are the rest.
    stored_bytes = sum(m.nbytes for m in model.modules() if isinstance(m, StoredLinear))
    floats = sum(p.numel() for p in model.parameters())
    assert floats < 49152 * 256 / 10  # the 12.6M-weight table is not among them
    assert stored_bytes > 0


def test_float_path_greedy_equals_transformers(reference):
    llm = LLM(str(FIXTURE), quantization="none", **OPTIONS)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for ids, out in zip(PROMPTS, outs, strict=True):
        assert out.outputs[0].token_ids == greedy(reference, ids, 16)[len(ids) :]


@needs_native
def test_every_stored_product_is_the_kernels_model_of_it(stored_llm, monkeypatch):
    """Each stored product of a batched step (merged parts of three types, row maps, the
    tied head over the scored rows) against kquant.reference_linear on its own input: the same
    activation quantization, float64 sums. (Whole models are not compared so: a rounding
    difference can move an activation across an int8 step in the next product.)"""
    native = kquant.kquant_linear
    seen = []

    def checked(x, weight, ggml_type, row_map=None, bias=None, fallback=None, tiles=None):
        out = native(x, weight, ggml_type, row_map, bias, fallback, tiles)
        want = kquant.reference_linear(x, weight, ggml_type, bias)
        if row_map is not None:
            placed = torch.empty_like(want)
            placed[:, row_map.long()] = want
            want = placed
        scale = want.abs().max().item()
        assert (out.double() - want).abs().max().item() <= 1e-6 * max(scale, 1.0) * 8
        seen.append((kquant.NAMES[ggml_type], x.shape[0], tiles is not None))
        return out

    monkeypatch.setattr(kquant, "kquant_linear", checked)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2)
    stored_llm.generate(PROMPTS, params, use_tqdm=False)
    names = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS")
    assert {name for name, _, _ in seen} == set(names)
    assert max(rows for _, rows, _ in seen) == sum(len(p) for p in PROMPTS)
    # The library's tiled types in tiles, the rest and the looked-up table (Q4_K) in place.
    tiled = {kquant.NAMES[t] for t in tiled_types()}
    want = {(name, name in tiled) for name in names}  # the tied table's head (Q4_K) in tiles too
    assert {(name, tiled) for name, _, tiled in seen} == want


def teacher_forced_against(llm, reference) -> int:
    """Each prompt and transformers' greedy continuation scored by `llm`: every token's
    logprob within BOUND of transformers' (MEAN_BOUND on average), and the same greedy choice
    wherever transformers' top two are further apart than GAP. Returns how many choices were
    so compared."""
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    checked, distances = 0, []
    for ids in PROMPTS:
        full = greedy(reference, ids, 16)
        with torch.inference_mode():
            logits = reference(torch.tensor([full])).logits[0].log_softmax(-1)
        scored = llm.generate([full], params, use_tqdm=False)[0].prompt_logprobs
        for pos in range(len(ids), len(full)):
            token = full[pos]
            distances.append(abs(scored[pos][token] - logits[pos - 1, token].item()))
            assert distances[-1] < BOUND
            top2 = logits[pos - 1].topk(2).values
            if top2[0] - top2[1] > GAP:
                assert max(scored[pos], key=scored[pos].get) == token
                checked += 1
    assert sum(distances) / len(distances) < MEAN_BOUND
    return checked


def test_stored_path_against_transformers_teacher_forced(stored_llm, reference):
    assert teacher_forced_against(stored_llm, reference) >= 5  # not rounding's choices


@needs_native
def test_long_steps_by_dequantized_tiles_against_transformers(stored_llm, reference, monkeypatch):
    """Where the float product measured faster for long steps (AMX), the tiles (or the rows of
    a type kept where it lies) are dequantized a chunk at a time (kquant.dequantized_linear,
    dequantized_rows_linear): forced on for every step here, each such product is the float64
    product of the file's values within float32 rounding, every type takes it, and the model
    stays within the bound of transformers' float evaluation."""
    native = kquant.dequantized_linear
    seen = set()

    def checked(x, tiles, ggml_type, out_features, bias=None):
        out = native(x, tiles, ggml_type, out_features, bias)
        w = torch.ops.quill.kquant_tile_dequant(tiles, ggml_type, out_features, torch.float32)
        want = x.double() @ w.double().T + (0 if bias is None else bias.double())
        magnitude = x.double().abs() @ w.double().abs().T
        assert ((out.double() - want).abs() <= 1e-5 * magnitude + 1e-6).all()
        seen.add(kquant.NAMES[ggml_type])
        return out

    rows_native = kquant.dequantized_rows_linear

    def checked_rows(x, weight, ggml_type, row_map=None, bias=None):
        out = rows_native(x, weight, ggml_type, row_map, bias)
        w = kquant.dequantize(weight, ggml_type).double()
        if row_map is not None:  # file row i is output row row_map[i]
            placed = torch.empty_like(w)
            placed[row_map.long()] = w
            w = placed
        want = x.double() @ w.T + (0 if bias is None else bias.double())
        magnitude = x.double().abs() @ w.abs().T
        assert ((out.double() - want).abs() <= 1e-5 * magnitude + 1e-6).all()
        seen.add(kquant.NAMES[ggml_type])
        return out

    monkeypatch.setattr(kquant, "dequantized_linear", checked)
    monkeypatch.setattr(kquant, "dequantized_rows_linear", checked_rows)
    stored = [m for m in stored_llm.engine.runner.model.modules() if isinstance(m, StoredLinear)]
    for m in stored:
        monkeypatch.setattr(m, "dequantize_above", 0)
    assert teacher_forced_against(stored_llm, reference) >= 5
    assert seen == set(kquant.NAMES.values())  # tiled or not, every type takes it


def test_loading_takes_no_more_memory_than_the_file_and_the_floats(tmp_path):
    """RSS after loading, in a fresh process, against before: at most the file, the floats
    quill makes (norms, and the tensors not read in place), the KV pool and 150 MB."""
    figures = load_in_fresh_process(FIXTURE)
    allowed = FIXTURE.stat().st_size + figures["floats"] + (8 << 20) + (150 << 20)
    assert figures["delta"] <= allowed, figures
