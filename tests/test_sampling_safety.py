"""Every legal sampling parameter, however extreme, samples a valid token from a valid distribution.

The property test drives the real sampler over batches of rows with mixed parameters and
logits with extreme values, and checks the token against the distribution the sampler itself
draws from, and against plain facts about greedy, top-p and top-k.
"""

from __future__ import annotations

import math
import sys

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from quill import SamplingParams
from quill.contract.errors import InvalidRequestError
from quill.contract.plan import SeqPlan
from quill.contract.sampling_params import GREEDY_TEMPERATURE
from quill.model.sampler import Sampler, apply_penalties, prepare_logits

F32_MAX = torch.finfo(torch.float32).max
# exclude_min would make hypothesis step to a subnormal, which flush-to-zero breaks.
_MIN_NORMAL = sys.float_info.min
END_IDS = [3, 60]  # the model's end-of-sequence ids in these tests (inside every vocab used)

# Subnormal floats are given explicitly: torch may have set flush-to-zero in this process, and
# hypothesis then refuses to draw them. top_p and repetition_penalty refuse them (see below).
_tiny = st.sampled_from([1e-300, 1e-45, 1e-38, 1e-20, 1e-6])
_temperature = st.one_of(
    st.just(0.0),
    _tiny,
    st.sampled_from([5e-324, 1e-320]),
    st.sampled_from([GREEDY_TEMPERATURE, 1e-4, 1e30, 1e300, 1.7e308]),
    st.floats(0.0, 5.0, allow_subnormal=False),
)
_top_p = st.one_of(
    _tiny,
    st.just(1.0),
    st.floats(_MIN_NORMAL, 1.0, allow_subnormal=False),
)
_top_k = st.one_of(
    st.sampled_from([-1, 0, 1, 2, 63, 64, 2**63 - 1, 2**63, 2**64, 2**70]),
    st.integers(1, 2**70),
)
_repetition = st.one_of(
    _tiny,
    st.sampled_from([0.5, 1.0, 1.3, 2.0, 1e30, 1e38, 1e300, 1.7e308]),
    st.floats(_MIN_NORMAL, 1.7e308, allow_subnormal=False),
)
_min_p = st.one_of(st.sampled_from([0.0, 1.0]), st.floats(0.0, 1.0, allow_subnormal=False))
_penalty = st.one_of(st.sampled_from([-2.0, 0.0, 2.0]), st.floats(-2.0, 2.0, allow_subnormal=False))


@st.composite
def _params(draw, vocab: int) -> SamplingParams:
    # Often temperature alone (no top-k, top-p, min-p), so the float64 reference gets a say.
    truncated = draw(st.booleans())
    return SamplingParams(
        temperature=draw(_temperature),
        top_p=draw(_top_p) if truncated else 1.0,
        top_k=draw(_top_k) if truncated else 0,
        min_p=draw(_min_p) if truncated else 0.0,
        repetition_penalty=draw(_repetition),
        presence_penalty=draw(_penalty),
        frequency_penalty=draw(_penalty),
        seed=draw(st.one_of(st.none(), st.integers(0, 2**64 - 1))),
        min_tokens=draw(st.integers(0, 4)),
        stop_token_ids=draw(st.lists(st.integers(0, vocab + 5), max_size=4)),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.one_of(st.none(), st.integers(0, 3))),
    )


def _seq(request_id: str, params: SamplingParams, prompt: list[int], output: list[int]) -> SeqPlan:
    """A decode step's plan for a request that has `output` so far (as the engine makes it)."""
    tokens = prompt + output
    history = params.uses_penalties
    return SeqPlan(
        request_id,
        tokens[-1:],
        len(tokens) - 1,
        len(prompt),
        [[0]],
        True,
        params,
        prompt if history else None,
        output[:] if history else None,
    )


_STYLES = ["normal", "huge", "extreme", "ties", "barred", "nonfinite", "flat_spread"]


def _logits(style: str, vocab: int, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(vocab, generator=gen)
    if style == "huge":
        return x * 1e36
    if style == "extreme":  # float32's limits, and numbers near zero
        pick = torch.randint(0, 4, (vocab,), generator=gen)
        values = torch.tensor([F32_MAX, -F32_MAX, 1e-30, -1e-30])
        return values[pick]
    if style == "ties":
        return torch.full((vocab,), 7.0)
    if style == "barred":  # most tokens already excluded (-inf), as a logits processor would
        # (at least 10 left: more than min_tokens can bar here, so some token stays legal)
        barred = torch.rand(vocab, generator=gen) < 0.9
        barred[torch.randperm(vocab, generator=gen)[:10]] = False
        return x.masked_fill(barred, float("-inf"))
    if style == "nonfinite":
        x[::7] = float("nan")
        x[1::11] = float("inf")
        x[2::13] = float("-inf")
        return x
    if style == "flat_spread":  # gaps far below a small temperature's resolution
        return x * 1e-6
    return x * 3


@st.composite
def _batch(draw):
    vocab = draw(st.sampled_from([64, 257, 1000]))
    rows = draw(st.integers(1, 5))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**32 - 1)))
    logits = torch.stack([_logits(draw(st.sampled_from(_STYLES)), vocab, gen) for _ in range(rows)])
    seqs = []
    for i in range(rows):
        params = draw(_params(vocab))
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        output = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        seqs.append(_seq(f"r{i}", params, prompt, output))
    return logits, seqs


def _barred(seq: SeqPlan) -> set[int]:
    p = seq.sampling_params
    produced = seq.start + len(seq.token_ids) - seq.num_prompt_tokens
    if produced >= p.min_tokens:
        return set()
    return set(p.stop_token_ids) | (set() if p.ignore_eos else set(END_IDS))


@pytest.mark.device
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=_batch())
def test_any_legal_params_sample_a_token_with_probability(batch, device):
    logits, seqs = batch
    logits = logits.to(device)
    vocab = logits.shape[-1]
    sampler = Sampler(device, seed=0, end_token_ids=END_IDS)
    probs = sampler.probs(logits, seqs)
    result = sampler(logits, seqs)
    prepared = prepare_logits(logits, seqs, END_IDS)
    assert not torch.isnan(probs).any()
    assert (probs >= 0).all() and (probs.sum(dim=-1) > 0).all()
    for row, (seq, token) in enumerate(zip(seqs, result.token_ids, strict=True)):
        p = seq.sampling_params
        assert 0 <= token < vocab
        assert probs[row, token] > 0, (row, token, p)
        assert token not in _barred(seq)
        values = prepared[row]
        if p.greedy:
            assert values[token] == values.max()  # argmax of the penalised logits
            assert token == int(values.argmax())
        elif p.top_p <= 1e-4:  # below the top token's share of any distribution here
            assert values[token] == values.max()
        if p.top_k > 0 and not p.greedy:
            k = min(p.top_k, vocab)
            assert values[token] >= values.topk(k).values[-1]
        plain = (p.top_k == 0 or p.top_k >= vocab) and p.top_p == 1 and p.min_p == 0
        if plain and not p.greedy:
            # Temperature alone: softmax(logits / T), here worked out in float64 (the sampler
            # takes temperatures beyond float32's range as its largest value).
            expected = (values.double() / min(p.temperature, F32_MAX)).softmax(dim=-1)
            assert torch.allclose(probs[row].double(), expected, atol=1e-5)
        if p.logprobs is not None:
            assert result.logprobs[row] is not None


@pytest.mark.device
def test_tiny_temperature_is_greedy_and_the_threshold_is_one_definition(device):
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-40).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).greedy
    logits = torch.tensor([[1.0, 1.0 + 1e-3, 0.5, -2.0]] * 3, device=device)
    temperatures = [0, 1e-40, 1e-300]
    seqs = [
        _seq(f"r{i}", SamplingParams(temperature=t), [0], []) for i, t in enumerate(temperatures)
    ]
    assert Sampler(device)(logits, seqs).token_ids == [1, 1, 1]


@pytest.mark.device
def test_huge_top_k_is_no_limit_and_tiny_top_p_keeps_the_top_token(device):
    logits = torch.tensor([[0.0, 2.0, 1.0, 0.5]], device=device)
    for top_k in (2**63, 2**64, 2**70):
        seq = _seq("r", SamplingParams(top_k=top_k), [0], [])
        assert (Sampler(device).probs(logits, [seq]) > 0).all()
    seq = _seq("r", SamplingParams(temperature=1.0, top_p=1e-300, seed=1), [0], [])
    sampler = Sampler(device)
    assert sampler.probs(logits, [seq]).tolist() == [[0.0, 1.0, 0.0, 0.0]]
    assert {sampler(logits, [seq]).token_ids[0] for _ in range(20)} == {1}


@pytest.mark.device
@pytest.mark.parametrize("rep", [2.3e-308, 1e-300, 1e-38, 1e38, 1e300, 1.7e308])
def test_extreme_repetition_penalty_keeps_order_and_stays_finite(rep, device):
    # token 0 and 2 were seen; 0 is positive, 2 negative; 1 and 3 were not seen
    logits = torch.tensor([[2.0, 1.0, -1.0, -3.0]], device=device)
    seq = _seq("r", SamplingParams(repetition_penalty=rep, temperature=0), [0, 2], [])
    out = apply_penalties(logits, [seq])
    assert torch.isfinite(out).all()
    assert out[0, 1] == 1.0 and out[0, 3] == -3.0  # unseen: untouched
    if rep < 1:  # rewards repetition: the seen positive token grows, the negative one shrinks
        assert out[0, 0] > 2.0 and -1.0 < out[0, 2] <= 0
    else:  # punishes it: towards 0 from above, and down without bound from below
        assert 0 <= out[0, 0] < 1.0 and out[0, 2] < -3.0
    assert Sampler(device)(logits, [seq]).token_ids == [0 if rep < 1 else 1]


@pytest.mark.device
def test_min_tokens_bars_end_and_stop_ids_until_reached(device):
    vocab = 8
    # the end id and the stop id are the two most likely tokens
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 8.0, 1.0, 0.0]], device=device)
    sampler = Sampler(device, end_token_ids=[3])
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[5])
    picks = [sampler(logits, [_seq("r", params, [1, 2], [6] * n)]).token_ids[0] for n in range(5)]
    assert picks == [6, 6, 6, 3, 3]  # outputs 0, 1, 2 so far: both barred; then allowed
    # With sampling too, the barred ids get no probability at all.
    sampled = SamplingParams(temperature=5.0, min_tokens=1, stop_token_ids=[5], seed=2)
    probs = sampler.probs(logits, [_seq("s", sampled, [1], [])])
    assert probs[0, 3] == 0 and probs[0, 5] == 0 and probs.sum() > 0
    assert all(
        sampler(logits, [_seq("s", sampled, [1], [])]).token_ids[0] not in (3, 5) for _ in range(50)
    )
    # ignore_eos: the end id is no end for this request, so only its stop ids are barred
    ignoring = SamplingParams(temperature=0, min_tokens=2, ignore_eos=True, stop_token_ids=[5])
    assert sampler(logits, [_seq("t", ignoring, [1], [])]).token_ids == [3]
    # a stop id outside the vocabulary is simply never sampled
    outside = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[vocab + 10, 2**62])
    assert sampler(logits, [_seq("u", outside, [1], [])]).token_ids == [5]


@pytest.mark.device
def test_min_tokens_counts_outputs_of_a_recomputed_request(device):
    # A preempted request recomputes prompt and output in one chunk; it has 2 outputs so far.
    params = SamplingParams(temperature=0, min_tokens=3)
    seq = SeqPlan("r", [1, 2, 3, 6, 6], 0, 3, [[0]], True, params)
    logits = torch.tensor([[0.0, 0.0, 0.0, 9.0, 0.0, 0.0, 1.0, 0.0]], device=device)
    assert Sampler(device, end_token_ids=[3])(logits, [seq]).token_ids == [6]
    seq = SeqPlan("r", [1, 2, 3, 6, 6, 6], 0, 3, [[0]], True, params)
    assert Sampler(device, end_token_ids=[3])(logits, [seq]).token_ids == [3]


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ],
)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_params_are_refused_by_name(field, value):
    with pytest.raises(InvalidRequestError, match=field) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field


def test_integer_fields_out_of_tensor_range_are_refused():
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(stop_token_ids=[2**63])
    assert info.value.param == "stop_token_ids"
    with pytest.raises(InvalidRequestError) as info:
        SamplingParams(top_k=-2)
    assert info.value.param == "top_k"
    assert SamplingParams(top_k=2**70).top_k == 2**70  # no limit, not an error


@pytest.mark.parametrize("field", ["top_p", "repetition_penalty"])
def test_subnormal_where_zero_is_refused_is_refused_whatever_the_float_mode(field):
    # Whether 5e-324 counts as 0 depends on the process's flush-to-zero mode; the answer must not.
    for value in (5e-324, 1e-310):
        with pytest.raises(InvalidRequestError) as info:
            SamplingParams(**{field: value})
        assert info.value.param == field
    assert getattr(SamplingParams(**{field: 2.3e-308}), field) == 2.3e-308
