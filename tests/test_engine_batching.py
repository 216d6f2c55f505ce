"""Each request's output is the same alone or in a batch, under any token budget or preemption."""

from __future__ import annotations

import pytest

from quill import LLM, SamplingParams
from tests.conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def alone(llm):
    """Reference: every prompt generated on its own."""
    return [llm.generate(p, GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]


@pytest.mark.parametrize("budget", [16, 64, 512])
def test_batch_invariance_under_token_budget(llm, alone, budget):
    scheduler = llm.engine.scheduler
    saved = scheduler.token_budget
    scheduler.token_budget = budget
    try:
        outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    finally:
        scheduler.token_budget = saved
    assert [o.outputs[0].token_ids for o in outputs] == alone


def test_chunked_prefill_keeps_decodes_running(llm):
    """With a small budget a long prompt is cut into chunks; running decodes are never starved."""
    engine = llm.engine
    scheduler = engine.scheduler
    saved = scheduler.token_budget
    scheduler.token_budget = 32
    try:
        short = engine.add_request("Hello", GREEDY)
        engine.step()  # the short prompt is taken in and starts decoding
        # Salted: earlier tests left this prompt in the prefix cache, and it must be computed.
        engine.add_request(
            PROMPTS[-1], SamplingParams(max_tokens=2, temperature=0), cache_salt="chunked"
        )
        steps = 0
        while engine.has_unfinished_requests():
            outs = engine.step()
            stats = engine.last_step
            steps += 1
            assert stats.num_batched_tokens <= 32
            if any(o.request_id == short and not o.finished for o in outs):
                assert stats.num_decode_tokens >= 1
        assert steps > len(llm.tokenizer.encode(PROMPTS[-1])) // 32
    finally:
        scheduler.token_budget = saved


def test_preemption_keeps_outputs(model_dir, alone):
    # 24 blocks of 16 tokens: the long prompts cannot all be resident, so requests get preempted.
    small = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_memory=24 * 16 * 30 * 2 * 3 * 64 * 4,
        max_num_batched_tokens=64,
    )
    assert small.engine.scheduler.kv.num_blocks == 24
    prompts = PROMPTS[:7]  # the 900-word prompt alone needs more than the whole pool
    outputs = small.generate(prompts, GREEDY, use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == alone[:7]
    assert sum(o.metrics.num_preemptions for o in outputs) == small.engine.scheduler.num_preemptions
    assert small.engine.scheduler.kv.pool.num_free_blocks == 24
    # Preempted requests found some of their own blocks still cached when they came back.
    assert small.engine.scheduler.kv.stats.hits > 0


def test_seeded_sampling_is_batch_invariant(llm):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    solo = llm.generate(PROMPTS[1], params, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(max_tokens=12, temperature=1.0)
    batch = llm.generate(
        [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[4]],
        [others, params, SamplingParams(max_tokens=5, temperature=0.7, seed=7), others],
        use_tqdm=False,
    )
    assert batch[1].outputs[0].token_ids == solo
    # and the seed matters: another seed gives another continuation
    other = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, top_k=50, seed=4321)
    assert llm.generate(PROMPTS[1], other, use_tqdm=False)[0].outputs[0].token_ids != solo


def test_priority_policy_serves_the_most_important_first(model_dir, alone):
    llm = LLM(
        str(model_dir),
        dtype="float32",
        quantization="none",
        scheduling_policy="priority",
        max_num_seqs=1,
    )
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, priority=[2, 0, 1])
    assert [o.outputs[0].token_ids for o in outputs] == alone[:3]  # in input order, unchanged
    first = [o.metrics.arrival_time + o.metrics.time_to_first_token for o in outputs]
    assert first[1] < first[2] < first[0]
