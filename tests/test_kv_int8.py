"""The int8 KV cache: its quantization worked by hand, and the engine serving from it.

The kernel against the reference on random paged layouts (int8 K and V, and each beside a float
type) is tests/test_attention.py's; the disaggregated transfer with int8 blocks is
tests/test_kv_transfer.py's. Here: what write_kv stores for values whose codes are known (both
paths, the same bytes), the error bound of any other value, and on the default model with fp32
weights: transformers' greedy tokens kept, the log-probabilities' move from the fp32 cache
bounded, the pool's capacity, the cost model's bytes, prefix-cache hits and preemption giving
the tokens a run without them gives.
"""

from __future__ import annotations

import pytest
import torch

from quill import LLM, SamplingParams
from quill.ops import reference
from tests.conftest import NATIVE, PROMPTS
from tests.test_model_reference import hf_greedy
from tests.test_prefix_caching import generate

needs_native = pytest.mark.skipif(NATIVE is None, reason="no native library")
PATHS = ["reference", pytest.param("native", marks=needs_native)]
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def write(path: str, k: torch.Tensor, v: torch.Tensor, block_size: int = 16):
    """k, v [tokens, heads, dim] into slots 0.. of a zeroed int8 cache; its codes and scales."""
    tokens, heads, dim = k.shape
    k_shape, v_shape = reference.kv_cache_shapes(2, heads, dim, block_size, torch.int8)
    k_cache, v_cache = (
        torch.zeros(k_shape, dtype=torch.int8),
        torch.zeros(v_shape, dtype=torch.int8),
    )
    slots = torch.arange(tokens)
    if path == "native":
        torch.ops.quill.write_kv(k, v, k_cache, v_cache, slots)
    else:
        reference.write_kv(k, v, k_cache, v_cache, slots)
    return k_cache, v_cache


@pytest.mark.parametrize("path", PATHS)
def test_hand_worked_codes_and_scales(path):
    s = 2.0**-6  # an fp16 scale, exactly: a group whose largest |x| is 127 s gets it
    group = torch.zeros(32)
    group[:6] = torch.tensor([127, -127, 0.5, 1.5, 2.5, -3.25]) * s
    k = torch.cat([group, torch.zeros(32)]).view(1, 1, 64)  # the second group all zeros
    v = torch.cat([torch.zeros(32), 2 * group]).view(1, 1, 64)
    k_cache, v_cache = write(path, k, v)
    pairs, scales = reference.key_parts(k_cache)  # [blocks, heads, 32, 16, 2], [.., 2, 16]
    # Keys in pairs of dimensions: dimensions 0-1 of slot 0, then of slot 1, ...
    assert pairs[0, 0, 0, 0].tolist() == [127, -127] and pairs[0, 0, 2, 0].tolist() == [2, -3]
    codes = reference.key_codes(k_cache)  # [blocks, heads, 16 slots, 64]
    # Round half to even: 0.5 -> 0, 1.5 -> 2, 2.5 -> 2; -3.25 -> -3.
    assert codes[0, 0, 0, :6].tolist() == [127, -127, 0, 2, 2, -3]
    assert not codes[0, 0, 0, 6:].any() and not codes[0, 0, 1:].any()
    assert scales[0, 0, :, 0].tolist() == [s, 0.0]  # an all-zero group: scale 0, codes 0
    v_scales = reference.value_parts(v_cache, 16)[1]
    v_codes = reference.value_codes(v_cache, 16)  # [blocks, heads, 16 slots, 64]
    assert v_codes[0, 0, 0, 32:38].tolist() == [127, -127, 0, 2, 2, -3]
    assert v_scales[0, 0, :, 0].tolist() == [0.0, 2 * s]
    # Read back: the multiples of s exactly, the others within half a step.
    keys, values = reference.gather_kv(k_cache, v_cache, torch.tensor([[0]]), torch.float32)
    assert keys[0, 0, 0, :6].tolist() == [127 * s, -127 * s, 0.0, 2 * s, 2 * s, -3 * s]
    assert values[0, 0, 0, 32:38].tolist() == [254 * s, -254 * s, 0.0, 4 * s, 4 * s, -6 * s]


@pytest.mark.parametrize("path", PATHS)
def test_any_value_reads_back_within_half_a_step(path):
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(32, 2, 128, generator=gen) * torch.logspace(-3, 2, 128)  # groups of all sizes
    v = torch.randn(32, 2, 128, generator=gen)
    k_cache, v_cache = write(path, k, v)
    keys, values = reference.gather_kv(k_cache, v_cache, torch.tensor([[0, 1]]), torch.float32)
    for x, back in ((k, keys[0].transpose(0, 1)), (v, values[0].transpose(0, 1))):
        groups = x.unflatten(-1, (-1, 32))
        step = (groups.abs().amax(-1, keepdim=True) / 127).half().float()
        err = (back.unflatten(-1, (-1, 32)) - groups).abs()
        assert (err <= step / 2 * (1 + 1e-6)).all()  # half a step, whatever the group's size


@needs_native
def test_native_and_reference_write_the_same_bytes():
    gen = torch.Generator().manual_seed(1)
    k, v = torch.randn(32, 3, 64, generator=gen), torch.randn(32, 3, 64, generator=gen)
    for dtype in (torch.float32, torch.bfloat16):
        native = write("native", k.to(dtype), v.to(dtype))
        ref = write("reference", k.to(dtype), v.to(dtype))
        assert torch.equal(native[0], ref[0]) and torch.equal(native[1], ref[1])


@pytest.fixture(scope="module")
def llm8(model_dir):
    return LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="int8",
        quantization="none",
        kv_cache_memory=256 << 20,
        max_num_seqs=64,
    )


def test_greedy_agrees_with_transformers(llm8, hf_model):
    """Tokens before the first difference, over the reference prompts (1 to ~1,000 tokens):
    99% measured (one prompt differs at its 11th token of 12); the issue's bar is 95%."""
    prompt_ids = [[1]] + [llm8.tokenizer.encode(p) for p in PROMPTS]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm8.generate(prompt_ids, params, use_tqdm=False)
    agreed = 0
    for ids, out in zip(prompt_ids, outputs, strict=True):
        want, got = hf_greedy(hf_model, ids, 12), out.outputs[0].token_ids
        agreed += next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), 12)
    assert agreed >= 0.95 * 12 * len(prompt_ids), agreed


# The move of the first sampled token's top-5 log-probabilities against the fp32 cache, over the
# reference prompts: measured int8 mean 0.024, largest 0.128; bf16 keys with int8 values 0.009
# and 0.054 (bf16 alone: 0.006 and 0.033). Bounds: 2x that.
MEAN_BOUND, WORST_BOUND = 0.05, 0.26


def test_logprobs_within_bound_of_fp32_cache(llm8, llm):
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    moves = []
    for prompt in PROMPTS:
        ours = llm8.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        ref = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].logprobs[0]
        moves += [abs(ours[t] - ref[t]) for t in ref if t in ours]
    assert len(moves) >= 4 * len(PROMPTS)  # the top 5 mostly the same tokens
    assert sum(moves) / len(moves) <= MEAN_BOUND and max(moves) <= WORST_BOUND, moves


def test_pool_holds_the_tokens_its_bytes_buy(llm8, llm):
    # fp32: 4 bytes an element; int8: 1 + 2/32 (the scales). 256 MiB -> 3.76x fp32's blocks.
    blocks8, blocks32 = llm8.engine.scheduler.kv.num_blocks, llm.engine.scheduler.kv.num_blocks
    assert blocks8 == int(blocks32 * 4 / 1.0625) or abs(blocks8 - blocks32 * 4 / 1.0625) < 1
    assert llm8.engine.accountant.model.kv_bytes_per_element == 1.0625
    k_cache, v_cache = llm8.engine.runner.kv_caches[0]
    assert k_cache.dtype == v_cache.dtype == torch.int8
    assert llm8.engine.runner.kv_bytes_per_block() == 30 * 2 * 3 * 16 * 64 * 1.0625


def test_prefix_cache_hits_give_the_same_tokens(llm8):
    base = llm8.tokenizer.encode(PROMPTS[-1])[:100]
    prompts = [base[:40] + [1000, 1001], base[:70] + [1002]]
    off = generate(llm8, prompts, caching=False, salt="int8-off")
    generate(llm8, [base], caching=True, salt="int8-on")
    on = generate(llm8, prompts, caching=True, salt="int8-on")
    assert [o.metrics.num_cached_tokens for o in on] == [32, 64]
    assert [o.outputs[0].token_ids for o in on] == [o.outputs[0].token_ids for o in off]


def test_preemption_gives_the_same_tokens(model_dir, llm8):
    alone = [llm8.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:7]]
    small = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="int8",
        quantization="none",
        kv_cache_memory=24 * 30 * 2 * 3 * 16 * 64 * 17 // 16,  # 24 blocks
        max_num_batched_tokens=64,
    )
    assert small.engine.scheduler.kv.num_blocks == 24
    outputs = small.generate(PROMPTS[:7], GREEDY, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone


def test_keys_and_values_apart(model_dir, llm):
    """bf16 keys beside int8 values: the pool sized by their mean bytes, and the native
    kernel (or the reference) reading both."""
    mixed = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="bf16,int8",
        quantization="none",
        kv_cache_memory=256 << 20,
    )
    k_cache, v_cache = mixed.engine.runner.kv_caches[0]
    assert (k_cache.dtype, v_cache.dtype) == (torch.bfloat16, torch.int8)
    assert mixed.engine.accountant.model.kv_bytes_per_element == (2 + 1.0625) / 2
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    got = mixed.generate(PROMPTS[:4], params, use_tqdm=False)
    want = llm.generate(PROMPTS[:4], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
