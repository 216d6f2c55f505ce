"""Prefix caching on the default model: the same tokens with it on and off, and hits where the
prompts share full blocks (after a prefix ending mid-block, a whole cached prompt, the `n`
samples of one prompt, a preempted request, an aborted one)."""

from __future__ import annotations

import pytest

from quill import SamplingParams
from tests.conftest import long_prompt

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def base(llm) -> list[int]:
    return llm.tokenizer.encode(long_prompt(120))


def generate(llm, prompts, caching: bool, salt: str):
    """Greedy outputs (and metrics) of `prompts` in one batch; `salt` keeps the test's cache
    apart from what other tests left behind."""
    engine = llm.engine
    kv = engine.scheduler.kv
    saved, kv.enable_prefix_caching = kv.enable_prefix_caching, caching
    try:
        ids = [
            engine.add_request(p, GREEDY, request_id=f"{salt}-{i}", cache_salt=salt)
            for i, p in enumerate(prompts)
        ]
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
    finally:
        kv.enable_prefix_caching = saved
    return [done[i] for i in ids]


def test_outputs_are_the_same_with_caching_on_and_off(llm, base):
    suffix = [1000 + i for i in range(9)]  # no token of it continues `base`
    shared = [5, 16, 37, 100]  # shorter than a block, one block, mid-block, several blocks
    prompts = [base[:k] + suffix for k in shared]
    prompts += [base[:64], base[:64], base[:70]]  # a whole prompt cached; and one more token
    off = generate(llm, [base] + prompts, caching=False, salt="off")
    warm = generate(llm, [base], caching=True, salt="on")  # fills the cache with `base`
    on = generate(llm, prompts, caching=True, salt="on")
    assert warm[0].outputs[0].token_ids == off[0].outputs[0].token_ids
    for a, b in zip(off[1:], on):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
    cached = [o.metrics.num_cached_tokens for o in on]
    # Whole blocks of the common prefix, short of each prompt's last token.
    expected = [min(k, len(p) - 1) // BLOCK * BLOCK for k, p in zip(shared + [64, 64, 70], prompts)]
    assert cached == expected == [0, 16, 32, 96, 48, 48, 64]
    assert all(o.metrics.num_cached_tokens == 0 for o in off)


def test_n_samples_share_the_prompt_computed_once(llm, base):
    engine = llm.engine
    prompt = base[:50]
    params = SamplingParams(max_tokens=3, temperature=0.8, seed=7)
    ids = [engine.add_request(prompt, params, cache_salt="n-test") for _ in range(3)]
    engine.step()
    step = engine.last_step
    # The first sample computes all 50 tokens; the others map its 3 full blocks in the same
    # step and compute only the 2 tokens after them.
    assert step.num_prefill_tokens == 50 + 2 * (50 - 48)
    requests = [engine.scheduler.requests[i] for i in ids]
    assert [r.num_cached_tokens for r in requests] == [0, 48, 48]
    while engine.has_unfinished_requests():
        engine.step()


def test_an_aborted_request_leaves_its_computed_blocks(llm, base):
    engine = llm.engine
    scheduler = engine.scheduler
    saved, scheduler.token_budget = scheduler.token_budget, 32
    try:
        first = engine.add_request(base[:80], GREEDY, cache_salt="abort-test")
        engine.step()
        engine.step()  # 64 of its 80 tokens are computed, 4 full blocks
        engine.abort_request(first)
        engine.step()
        second = engine.add_request(base[:80] + [7, 8], GREEDY, cache_salt="abort-test")
        engine.step()
        assert engine.scheduler.requests[second].num_cached_tokens == 64
    finally:
        scheduler.token_budget = saved
    while engine.has_unfinished_requests():
        engine.step()


def test_salts_keep_caches_apart(llm, base):
    a = generate(llm, [base[:40]], caching=True, salt="tenant-a")
    b = generate(llm, [base[:40]], caching=True, salt="tenant-b")
    again = generate(llm, [base[:40]], caching=True, salt="tenant-a")
    assert [o.metrics.num_cached_tokens for o in a + b + again] == [0, 0, 32]
