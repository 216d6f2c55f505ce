"""Prompt logprobs (scoring a prompt) against transformers' log-softmax of the same prompt.

The engine scores a request's prompt rows chunk by chunk: under a small token budget, after
another request cached the same prompt (the scoring request computes it anyway), beside
ordinary requests in one step (theirs unchanged), and with max_tokens 0 (the prompt alone).
"""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

from quill import LLM, SamplingParams
from quill.contract.errors import InvalidRequestError
from quill.contract.plan import StepResult
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler

PROMPTS = [
    "The capital of France is Paris. The capital of Germany is Berlin. The capital of Italy is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]


@pytest.fixture(scope="module")
def reference(hf_model, tokenizer):
    """Per prompt: its ids and transformers' fp32 log-softmax at every position."""
    out = {}
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt).ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0].float()
        out[prompt] = (ids, logits.log_softmax(-1))
    return out


@contextmanager
def token_budget(llm: LLM, num_tokens: int):
    """The session engine with a smaller step budget until the block ends."""
    saved = llm.engine.scheduler.token_budget
    llm.engine.core.set_token_budget(num_tokens)
    try:
        yield llm
    finally:
        llm.engine.core.set_token_budget(saved)


class PlanRecorder:
    def __init__(self, llm: LLM) -> None:
        self.listeners = llm.engine.core.step_listeners
        self.plans = []

    def on_step(self, plan, start, end) -> None:
        self.plans.append(plan)

    def __enter__(self):
        self.listeners.append(self)
        return self

    def __exit__(self, *exc) -> None:
        self.listeners.remove(self)


def check_against_reference(out, reference, top_n: int) -> None:
    ids, ref = reference[out.prompt]
    assert out.prompt_token_ids == ids
    scored, ranks = out.prompt_logprobs, out.prompt_logprob_ranks
    assert len(scored) == len(ranks) == len(ids)
    assert scored[0] is None and ranks[0] is None
    for i in range(1, len(ids)):
        row = ref[i - 1]
        entry = scored[i]
        assert entry[ids[i]] == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert ranks[i] == int((row > row[ids[i]]).sum()) + 1
        top = row.topk(top_n)
        others = {t: lp for t, lp in entry.items() if t != ids[i]}
        expected = {t: lp for t, lp in zip(top.indices.tolist(), top.values.tolist())}
        # The top n, with the prompt token added when it is not among them.
        assert set(entry) == set(expected) | {ids[i]}
        for t, lp in others.items():
            assert lp == pytest.approx(expected[t], abs=1e-4)


def test_prompt_logprobs_match_transformers(llm, reference):
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    for out in outs:
        check_against_reference(out, reference, 3)
        assert len(out.outputs[0].token_ids) == 2


def test_chunked_prefill_scores_every_chunk(llm, reference):
    with token_budget(llm, 7), PlanRecorder(llm) as recorder:
        params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=2)
        out = llm.generate(PROMPTS[0], params, use_tqdm=False)[0]
    check_against_reference(out, reference, 2)
    chunks = [s for p in recorder.plans for s in p.seqs if s.prompt_logprob_token_ids]
    assert len(chunks) >= 3 and all(s.num_tokens <= 7 for s in chunks)
    # Each chunk scores the prompt tokens after its rows: together every one but the first.
    scored = [t for s in chunks for t in s.prompt_logprob_token_ids]
    assert scored == out.prompt_token_ids[1:]


def test_a_cached_prompt_is_computed_again_to_be_scored(llm, reference):
    prompt = PROMPTS[2]
    plain = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompt, plain, use_tqdm=False)  # its blocks are now in the prefix cache
    again = llm.generate(prompt, plain, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0  # the cache holds it
    scoring = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    out = llm.generate(prompt, scoring, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0
    check_against_reference(out, reference, 1)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids


def test_scoring_beside_ordinary_requests_leaves_theirs_unchanged(llm, reference):
    plain = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    alone = llm.generate(PROMPTS[1:], plain, use_tqdm=False)
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=2)
    with PlanRecorder(llm) as recorder:
        outs = llm.generate([PROMPTS[0], *PROMPTS[1:]], [scoring, plain, plain], use_tqdm=False)
    # One step ran the scoring chunk beside the others' prompts.
    assert any(
        any(s.prompt_logprob_token_ids for s in p.seqs)
        and any(s.samples and not s.prompt_logprob_token_ids for s in p.seqs)
        for p in recorder.plans
    )
    check_against_reference(outs[0], reference, 2)
    for together, single in zip(outs[1:], alone):
        assert together.prompt_logprobs is None
        assert together.outputs[0].token_ids == single.outputs[0].token_ids
        for a, b in zip(together.outputs[0].logprobs, single.outputs[0].logprobs):
            assert a.keys() == b.keys()
            assert all(a[t] == pytest.approx(b[t], abs=1e-5) for t in a)


def test_max_tokens_zero_scores_the_prompt_alone(llm, reference):
    out = llm.generate(PROMPTS[1], SamplingParams(max_tokens=0, prompt_logprobs=0), use_tqdm=False)
    completion = out[0].outputs[0]
    assert completion.token_ids == [] and completion.text == ""
    assert completion.finish_reason == "length"
    assert out[0].metrics.time_to_first_token is None
    check_against_reference(out[0], reference, 0)


def test_sampling_params_bounds():
    assert SamplingParams(max_tokens=0).max_tokens == 0
    for bad in ({"max_tokens": -1}, {"prompt_logprobs": -1}, {"prompt_logprobs": 21}):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(**bad)
        assert e.value.param == next(iter(bad))


class _ScoringExecutor:
    """Scores each prompt token as its own id (logprob -id), so a misplaced or repeated entry
    shows; samples token 7."""

    def __init__(self) -> None:
        self.plans = []

    def execute(self, plan) -> StepResult:
        self.plans.append(plan)
        sampled = {s.request_id: [7] for s in plan.seqs if s.samples}
        scored = {
            s.request_id: [(-float(t), 1, []) for t in s.prompt_logprob_token_ids]
            for s in plan.seqs
            if s.prompt_logprob_token_ids
        }
        return StepResult(sampled, prompt_logprobs=scored)


def test_preempted_scoring_request_keeps_one_entry_per_token():
    """A pool too small for both: the later request is preempted mid-prompt and recomputed;
    what it scored before is not scored twice, and no position is skipped."""
    clock = VirtualClock()
    executor = _ScoringExecutor()
    scheduler = Scheduler(KVCacheManager(8, 4, enable_prefix_caching=True), 6, 4, 64)
    core = EngineCore(scheduler, executor, clock)
    params = SamplingParams(max_tokens=6, ignore_eos=True, prompt_logprobs=0)
    a = Request("a", list(range(100, 118)), params, 0.0, 6)
    b = Request("b", list(range(200, 210)), params, 0.0, 6)
    core.add_request(a)
    core.add_request(b)
    finished = []
    while core.has_unfinished_requests():
        finished += core.step().finished
    assert scheduler.num_preemptions > 0
    for r in (a, b):
        assert [-lp for lp, _, _ in r.prompt_logprobs] == r.prompt_token_ids[1:]
        assert r.output_token_ids == [7] * 6


def test_a_request_that_scores_reuses_no_cached_block_it_has_not_scored():
    kv = KVCacheManager(16, 4, enable_prefix_caching=True)
    first = Request("first", list(range(12)), SamplingParams(), 0.0, 4)
    assert kv.allocate_slots(first, 12)
    kv.cache_blocks(first, 12)
    scoring = Request("scoring", list(range(12)), SamplingParams(prompt_logprobs=0), 0.0, 4)
    assert kv.find_cached_prefix(scoring) == [[]]
    scoring.prompt_logprobs = [(0.0, 1, [])] * 5  # tokens 1..5 scored: positions 0..4 done
    assert len(kv.find_cached_prefix(scoring)[0]) == 1  # the block of positions 0..3
    scoring.prompt_logprobs = [(0.0, 1, [])] * 11  # all scored: any prefix again
    assert len(kv.find_cached_prefix(scoring)[0]) == 2
