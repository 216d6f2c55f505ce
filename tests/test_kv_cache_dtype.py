"""16-bit KV caches: what `auto` picks, what they hold, and how far they move the model.

fp32 weights with a bf16 or fp16 cache keep transformers' greedy tokens on the reference
prompts (one token up to ~1,200), and move the next-token log-probabilities by at most a stated
bound from the fp32-cache engine; the pool holds twice the blocks, and the cost model prices
two bytes per element.
"""

from __future__ import annotations

import pytest
import torch

from quill import LLM, SamplingParams
from quill.contract.kv_format import KVCacheFormat
from quill.model.loader import resolve_kv_cache_dtype
from quill.ops import memory
from tests.conftest import PROMPTS
from tests.test_model_reference import hf_greedy

# Largest move of a top-5 log-probability of the first sampled token against the fp32 cache,
# over the reference prompts. Measured on a Zen 4: bf16 0.003-0.032, fp16 0.0001-0.013 (the
# largest on the 900-word prompt, whose second chunk reads the rounded cache). Bounds: 2x that.
LOGPROB_BOUND = {torch.bfloat16: 0.065, torch.float16: 0.027}


@pytest.fixture(scope="module", params=[torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def llm16(request, model_dir):
    dtype = request.param
    llm = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype=str(dtype).removeprefix("torch."),
        quantization="none",
        kv_cache_memory=256 << 20,
        max_num_seqs=64,
    )
    name = str(dtype).removeprefix("torch.")
    assert llm.engine.kv_format == KVCacheFormat(name, name)
    return llm


def both(name: str) -> KVCacheFormat:
    return KVCacheFormat(name, name)


def test_auto_is_sixteen_bit(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    import quill.model.loader as loader

    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: True)
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == both("bfloat16")
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: False)
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu) == both("float16")
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, cpu) == both("bfloat16")
    assert resolve_kv_cache_dtype("auto", torch.float16, cuda) == both("float16")
    assert resolve_kv_cache_dtype("auto", torch.float32, cuda) == both("bfloat16")
    assert resolve_kv_cache_dtype("float32", torch.bfloat16, cpu) == both("float32")
    # float32 weights asked for by name: float32 arithmetic, the cache's too.
    assert resolve_kv_cache_dtype("auto", torch.float32, cpu, dtype_asked=True) == both("float32")
    assert resolve_kv_cache_dtype("float16", torch.float32, cpu, dtype_asked=True) == both(
        "float16"
    )
    # int8 only by name; K and V apart, either side auto.
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, cpu) == both("int8")
    assert resolve_kv_cache_dtype("auto,int8", torch.bfloat16, cpu) == KVCacheFormat(
        "bfloat16", "int8"
    )
    assert resolve_kv_cache_dtype("int8,float32", torch.bfloat16, cpu).name == "int8,float32"


def test_the_cost_model_counts_the_kv_bytes_auto_gives():
    from quill.cost.model import kv_bytes_per_element

    assert kv_bytes_per_element("auto") == 2
    assert kv_bytes_per_element("auto", "float32") == 4
    assert kv_bytes_per_element("auto", "bfloat16") == 2
    assert kv_bytes_per_element("float32") == 4
    # int8: a byte a code and a 2-byte scale per 32 of them; K,V apart: their mean.
    assert kv_bytes_per_element("int8") == 1.0625
    assert kv_bytes_per_element("bfloat16,int8") == (2 + 1.0625) / 2
    assert kv_bytes_per_element("auto,int8", "float32") == (4 + 1.0625) / 2


def test_kv_cache_dtype_names():
    from quill.config import EngineConfig

    for bad in ("int4", "bfloat16,int8,int8", "fp8_e4m3"):
        with pytest.raises(ValueError, match="kv_cache_dtype"):
            EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="fp8 KV is not offered"):
        EngineConfig(kv_cache_dtype="fp8")
    assert EngineConfig(kv_cache_dtype="bf16").kv_cache_dtype == "bfloat16"
    assert EngineConfig(kv_cache_dtype="q8_0").kv_cache_dtype == "int8"  # llama.cpp's name
    assert EngineConfig(kv_cache_dtype="bf16, int8").kv_cache_dtype == "bfloat16,int8"
    assert EngineConfig(kv_cache_dtype="int8,int8").kv_cache_dtype == "int8"


def test_greedy_matches_transformers(llm16, hf_model):
    prompt_ids = [[1]] + [llm16.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm16.generate(prompt_ids, params, use_tqdm=False)
    for ids, out in zip(prompt_ids, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, ids, 12), f"{len(ids)} tokens"


def test_logprobs_within_bound_of_fp32_cache(llm16, llm):
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    worst = 0.0
    for prompt in PROMPTS:
        ours = llm16.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        ref = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        assert set(ours) == set(ref)
        worst = max(worst, max(abs(ours[t] - ref[t]) for t in ref))
    assert worst <= LOGPROB_BOUND[llm16.engine.runner.kv_dtypes[0]], worst


def test_pool_holds_twice_the_blocks_and_costs_two_bytes(llm16, llm):
    assert llm16.engine.scheduler.kv.num_blocks == 2 * llm.engine.scheduler.kv.num_blocks
    assert llm16.engine.accountant.model.kv_bytes_per_element == 2
    assert llm.engine.accountant.model.kv_bytes_per_element == 4
    k_cache, v_cache = llm16.engine.runner.kv_caches[0]
    assert (k_cache.dtype, v_cache.dtype) == llm16.engine.runner.kv_dtypes


def test_huge_page_tensors_are_zeroed_and_writable():
    t = memory.zeros((3, 5, 7), torch.bfloat16, torch.device("cpu"))
    assert t.shape == (3, 5, 7) and t.dtype == torch.bfloat16 and not t.any()
    assert t.data_ptr() % memory.HUGE_PAGE == 0
    t.fill_(2.0)
    assert t.sum().item() == 2.0 * 105
    assert memory.zeros((0, 4), torch.float32, torch.device("cpu")).numel() == 0
