"""Speculative decoding end to end (issue 24): the engine with n-gram drafts on every step
against the same engine without, on the same weights and the exact fp32 path.

Greedy replies must be token for token the same (and their logprobs the same numbers); the
limits (max_tokens, stop ids, stop strings, min_tokens, the context) must cut them where they
cut the plain engine's; sampled replies must be distributed as the plain engine's, checked by
a chi-square test on the first tokens of many replies; KV blocks booked for rejected drafts
must all come back.
"""

from __future__ import annotations

import gc
import math
from collections import Counter
from contextlib import contextmanager

from quill import LLM, SamplingParams
from quill.config import SpeculativeConfig
from quill.contract.messages import SpecDecodeStats
from tests.conftest import PROMPTS

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3, "by_cost": False}  # fmt: skip

PASSAGE = (
    "The library opens at nine in the morning and closes at six in the evening. On Saturdays "
    "it opens at ten and closes at four. Books may be borrowed for three weeks and renewed "
    "twice, online or at the front desk."
)
GROUNDED = [
    f"<|im_start|>user\nRepeat this text exactly:\n{PASSAGE}<|im_end|>\n<|im_start|>assistant\n",
    f"<|im_start|>user\nFix the spelling: {PASSAGE.replace('borrowed', 'borowed')}<|im_end|>\n"
    "<|im_start|>assistant\n",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]


@contextmanager
def drafting(llm: LLM, config: dict = NGRAM):
    """The same engine (weights, kernels, KV pool) with speculative decoding on, as
    `speculative_config=config` starts it, until the block ends: what differs between the two
    sides of a comparison is the drafts alone (and the suite holds no second model)."""
    scheduler = llm.engine.scheduler
    saved = scheduler.speculative, scheduler.spec_switch, scheduler.spec_stats
    spec = SpeculativeConfig.from_dict(config)
    scheduler.speculative, scheduler.spec_switch = spec, None
    scheduler.spec_stats = SpecDecodeStats(accepted_per_position=[0] * spec.num_speculative_tokens)
    try:
        yield llm
    finally:
        scheduler.speculative, scheduler.spec_switch, scheduler.spec_stats = saved


def _run(llm: LLM, prompts, params: SamplingParams):
    return llm.generate(prompts, params, use_tqdm=False)


def test_greedy_replies_and_logprobs_are_the_plain_engines(llm):
    prompts = PROMPTS + GROUNDED
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    plain = _run(llm, prompts, params)
    with drafting(llm):
        spec = _run(llm, prompts, params)
        stats = llm.engine.last_step.spec_decode
    drafted = accepted = 0
    for p, s in zip(plain, spec, strict=True):
        a, b = p.outputs[0], s.outputs[0]
        assert b.token_ids == a.token_ids, s.prompt
        assert b.finish_reason == a.finish_reason
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.keys() == y.keys()
            assert all(math.isclose(x[t], y[t], abs_tol=1e-3) for t in x)
        drafted += s.metrics.num_draft_tokens
        accepted += s.metrics.num_accepted_tokens
        assert p.metrics.num_draft_tokens == 0
    # The test means something only if drafts were made, and some held, and some did not.
    assert drafted > 0 and 0 < accepted < drafted
    assert (stats.num_draft_tokens, stats.num_accepted_tokens) == (drafted, accepted)
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_one_at_a_time_replies_match_too(llm):
    params = SamplingParams(temperature=0, max_tokens=64)
    for prompt in GROUNDED:
        a = _run(llm, [prompt], params)[0]
        with drafting(llm):
            b = _run(llm, [prompt], params)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.metrics.num_accepted_tokens > 0  # these replies repeat their input


def test_limits_cut_where_they_cut_without_drafts(llm):
    prompt = GROUNDED[0]
    full = _run(llm, [prompt], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0]
    cases = [
        SamplingParams(temperature=0, max_tokens=7),
        SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[full.token_ids[9]]),
        SamplingParams(temperature=0, max_tokens=40, stop=[full.text[30:38]]),
        SamplingParams(temperature=0, max_tokens=40, min_tokens=12),
        SamplingParams(
            temperature=0, max_tokens=40, stop=[full.text[30:38]], include_stop_str_in_output=True
        ),  # fmt: skip
    ]
    for params in cases:
        a = _run(llm, [prompt], params)[0].outputs[0]
        with drafting(llm):
            b = _run(llm, [prompt], params)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.stop_reason,
        ), params
    with drafting(llm):
        limited = _run(llm, [prompt], cases[0])[0]
    assert len(limited.outputs[0].token_ids) == 7 and limited.outputs[0].finish_reason == "length"
    assert limited.metrics.num_draft_tokens > 0


def test_the_context_limit_holds_and_the_config_starts_it(model_dir):
    """Drafts never run a request past max_model_len (the last positions take none); an engine
    started with speculative_config drafts, and without its drafts answers the same."""
    prompt = GROUNDED[0]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
    options = dict(dtype="float32", kv_cache_dtype="float32", quantization="none")
    with LLM(str(model_dir), max_model_len=96, kv_cache_memory=32 << 20,
             speculative_config=NGRAM, **options) as spec:  # fmt: skip
        b = _run(spec, [prompt], params)[0]
        scheduler = spec.engine.scheduler
        saved, scheduler.speculative = scheduler.speculative, None
        a = _run(spec, [prompt], params)[0]
        scheduler.speculative = saved
    del spec
    gc.collect()
    assert b.outputs[0].token_ids == a.outputs[0].token_ids
    assert len(b.prompt_token_ids) + len(b.outputs[0].token_ids) == 96
    assert b.metrics.num_accepted_tokens > 0 and a.metrics.num_draft_tokens == 0


def test_rejected_drafts_give_their_blocks_back(llm):
    engine = llm.engine
    kv = engine.scheduler.kv
    params = SamplingParams(temperature=0, max_tokens=48)
    with drafting(llm):
        _run(llm, PROMPTS + GROUNDED, params)
        assert not kv.block_tables  # every request's blocks went back
        assert kv.pool.num_free_blocks == kv.num_blocks
        # While one runs, its table holds what its verified tokens need, plus at most a block.
        engine.add_request(GROUNDED[1], params, request_id="watch")
        while engine.has_unfinished_requests():
            engine.step()
            request = engine.scheduler.requests.get("watch")
            if request is not None and request.num_computed_tokens:
                held = len(kv.block_tables["watch"][0])
                assert held <= kv.blocks_for(request.num_computed_tokens + 1)


def _chi2_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile for p = 1e-4 (z its normal quantile), by Wilson and Hilferty."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def test_sampled_replies_are_distributed_as_without_drafts(llm):
    """Two samples of the first three tokens (480 replies each) from the same distribution,
    by a chi-square test of homogeneity; the prompt makes drafts at once."""
    # 33 tokens: two full blocks, cached after the first replies, so the rest skip them.
    prompt = "one two three four " * 8 + "one"
    n = 480
    params = [SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True) for _ in range(n)]
    plain = _run(llm, [prompt] * n, params)
    with drafting(llm):
        spec = _run(llm, [prompt] * n, params)
    drafted = sum(o.metrics.num_draft_tokens for o in spec)
    accepted = sum(o.metrics.num_accepted_tokens for o in spec)
    assert drafted > n and 0 < accepted < drafted
    plain, spec = (Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs)
                   for outs in (plain, spec))  # fmt: skip
    # Rare replies pooled so every cell expects at least 5.
    common = [k for k in plain | spec if plain[k] + spec[k] >= 20]
    rows = [(plain[k], spec[k]) for k in common]
    rows.append((n - sum(plain[k] for k in common), n - sum(spec[k] for k in common)))
    rows = [r for r in rows if sum(r) > 0]
    assert len(rows) >= 3  # a distribution with something to compare
    stat = sum((a - b) ** 2 / (a + b) for a, b in rows)  # equal sample sizes
    assert stat < _chi2_critical(len(rows) - 1), (stat, rows)
