"""Speculative decoding end to end (issue 24): the engine with n-gram drafts on every step
against the same engine without, on the same weights and the exact fp32 path.

Greedy replies must be token for token the same (and their logprobs the same numbers); the
limits (max_tokens, stop ids, stop strings, min_tokens, the context) must cut them where they
cut the plain engine's; sampled replies must be distributed as the plain engine's, checked by
a chi-square test on the first tokens of many replies; KV blocks booked for rejected drafts
must all come back.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest

from quill import LLM, SamplingParams
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


def same_kernels(source: LLM, target: LLM) -> LLM:
    """`target` runs its products on the kernels `source` measured fastest at its start (each
    engine measures its own: two could pick differently, and round a near tie apart)."""
    pairs = zip(source.engine.runner.model.modules(), target.engine.runner.model.modules())
    for a, b in pairs:
        for name in ("native_max_rows", "split_products"):
            if hasattr(a, name):
                setattr(b, name, getattr(a, name))
    return target


@pytest.fixture(scope="module")
def spec_llm(model_dir, llm):
    spec = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_memory=256 << 20,
        max_num_seqs=64,
        speculative_config=NGRAM,
    )
    return same_kernels(llm, spec)


def _run(llm: LLM, prompts, params: SamplingParams):
    return llm.generate(prompts, params, use_tqdm=False)


def test_greedy_replies_and_logprobs_are_the_plain_engines(llm, spec_llm):
    prompts = PROMPTS + GROUNDED
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=2)
    plain, spec = _run(llm, prompts, params), _run(spec_llm, prompts, params)
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
    stats = spec_llm.engine.last_step.spec_decode
    assert stats.num_draft_tokens >= drafted and stats.num_accepted_tokens >= accepted
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens


def test_one_at_a_time_replies_match_too(llm, spec_llm):
    params = SamplingParams(temperature=0, max_tokens=64)
    for prompt in GROUNDED:
        a = _run(llm, [prompt], params)[0]
        b = _run(spec_llm, [prompt], params)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert b.metrics.num_accepted_tokens > 0  # these replies repeat their input


def test_limits_cut_where_they_cut_without_drafts(llm, spec_llm):
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
        b = _run(spec_llm, [prompt], params)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == (
            a.token_ids,
            a.text,
            a.finish_reason,
            a.stop_reason,
        ), params
    limited = _run(spec_llm, [prompt], cases[0])[0]
    assert len(limited.outputs[0].token_ids) == 7 and limited.outputs[0].finish_reason == "length"


def test_the_context_limit_holds(model_dir):
    """Drafts never run a request past max_model_len (the last positions take none)."""
    prompt = GROUNDED[0]
    with LLM(str(model_dir), dtype="float32", kv_cache_dtype="float32", quantization="none",
             max_model_len=96, kv_cache_memory=64 << 20) as plain, LLM(
        str(model_dir), dtype="float32", kv_cache_dtype="float32", quantization="none",
        max_model_len=96, kv_cache_memory=64 << 20, speculative_config=NGRAM,
    ) as spec:  # fmt: skip
        same_kernels(plain, spec)
        params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=None)
        a = _run(plain, [prompt], params)[0]
        b = _run(spec, [prompt], params)[0]
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.prompt_token_ids) + len(b.outputs[0].token_ids) == 96
        assert b.metrics.num_accepted_tokens > 0


def test_rejected_drafts_give_their_blocks_back(spec_llm):
    kv = spec_llm.engine.scheduler.kv
    params = SamplingParams(temperature=0, max_tokens=48)
    _run(spec_llm, PROMPTS + GROUNDED, params)
    assert not kv.block_tables  # every request's blocks went back
    assert kv.pool.num_free_blocks == kv.num_blocks
    # While one runs, its table holds what its verified tokens need, plus at most one block.
    engine = spec_llm.engine
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


def test_sampled_replies_are_distributed_as_without_drafts(llm, spec_llm):
    """Two samples of the first three tokens (480 replies each) from the same
    distribution, by a chi-square test of homogeneity; the prompt makes drafts at once."""
    # 33 tokens: two full blocks, cached after the first replies, so the rest skip them.
    prompt = "one two three four " * 8 + "one"
    n = 480
    counts = []
    for engine in (llm, spec_llm):
        params = [SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True) for _ in range(n)]
        outs = engine.generate([prompt] * n, params, use_tqdm=False)
        counts.append(Counter(tuple(o.outputs[0].token_ids[:3]) for o in outs))
        if engine is spec_llm:
            drafted = sum(o.metrics.num_draft_tokens for o in outs)
            accepted = sum(o.metrics.num_accepted_tokens for o in outs)
            assert drafted > n and 0 < accepted < drafted
    plain, spec = counts
    # Rare replies pooled so every cell expects at least 5.
    common = [k for k in plain | spec if plain[k] + spec[k] >= 20]
    rows = [(plain[k], spec[k]) for k in common]
    rows.append((n - sum(plain[k] for k in common), n - sum(spec[k] for k in common)))
    rows = [r for r in rows if sum(r) > 0]
    assert len(rows) >= 3  # a distribution with something to compare
    stat = sum((a - b) ** 2 / (a + b) for a, b in rows)  # equal sample sizes
    assert stat < _chi2_critical(len(rows) - 1), (stat, rows)
