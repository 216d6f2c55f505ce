"""What `quill bench serve` sends: arrival processes (checked statistically with fixed seeds),
prompts of exact token lengths in the default model's tokenizer, and dataset files."""

from __future__ import annotations

import json
import math
import random
import statistics

import pytest

from quill.bench.datasets import (
    DatasetEntry,
    random_requests,
    read_dataset,
    sample_requests,
)
from quill.bench.prompts import ExactPrompts, load_tokenizer
from quill.bench.serve import resolve_seed
from quill.sim.workload import LengthSpec, arrival_times

N = 20_000


def _gaps(offsets: list[float]) -> list[float]:
    return [b - a for a, b in zip(offsets, offsets[1:])]


# -- arrivals ------------------------------------------------------------------------------
def arrival_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    return list(arrival_times(n, rate, burstiness, seed))


def test_poisson_arrivals_have_exponential_gaps():
    rate = 5.0
    offsets = arrival_offsets(N + 1, rate, burstiness=1.0, seed=11)
    assert offsets[0] == 0.0
    gaps = _gaps(offsets)
    mean = statistics.fmean(gaps)
    cv = statistics.stdev(gaps) / mean
    # The mean of 20000 exponential gaps has a relative standard error of 1/sqrt(20000) = 0.7%,
    # their CV about sqrt((9 - 1) / (4 * 20000)) = 1% (kurtosis 9): 3% and 4% are > 4 sigma.
    assert mean == pytest.approx(1 / rate, rel=0.03)
    assert cv == pytest.approx(1.0, abs=0.04)
    # The shape, not only two moments: P(gap > mean) = e^-1 for an exponential (SE 0.34%).
    beyond = sum(g > 1 / rate for g in gaps) / len(gaps)
    assert beyond == pytest.approx(math.exp(-1), abs=0.015)


@pytest.mark.parametrize(
    ("shape", "cv_tol", "mean_tol"),
    [
        # SE of the CV ~ CV * sqrt((kurtosis - 1) / (4n)) with kurtosis 3 + 6/k;
        # SE of the mean ~ CV / sqrt(n). Tolerances are about 4 sigma.
        (0.25, 0.15, 0.06),  # CV 2: SE 0.036 (kurtosis 27), mean 1.4%
        (4.0, 0.02, 0.02),  # CV 0.5: SE 0.0047, mean 0.35%
    ],
)
def test_gamma_arrivals_keep_the_mean_and_spread_as_1_over_sqrt_shape(shape, cv_tol, mean_tol):
    rate = 2.0
    gaps = _gaps(arrival_offsets(N + 1, rate, burstiness=shape, seed=7))
    mean = statistics.fmean(gaps)
    assert mean == pytest.approx(1 / rate, rel=mean_tol)
    assert statistics.stdev(gaps) / mean == pytest.approx(1 / math.sqrt(shape), abs=cv_tol)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf, burstiness=0.5, seed=1) == [0.0] * 5
    assert arrival_offsets(0, 3.0) == []


def test_arrivals_repeat_with_their_seed_and_differ_across_seeds():
    a = arrival_offsets(50, 10.0, seed=1)
    assert a == arrival_offsets(50, 10.0, seed=1)
    assert a != arrival_offsets(50, 10.0, seed=2)
    assert all(x <= y for x, y in zip(a, a[1:]))


@pytest.mark.parametrize(("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.0)])
def test_arrivals_refuse_bad_settings(rate, burstiness):
    with pytest.raises(ValueError):
        arrival_offsets(3, rate, burstiness)


# -- exact-length prompts --------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_dir():
    from quill.model.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="module")
def prompts(default_dir) -> ExactPrompts:
    return ExactPrompts(load_tokenizer(default_dir))


@pytest.fixture(scope="module")
def server_tokenizer(default_dir):
    """The tokenizer as quill's server loads it (transformers), to count as the server does."""
    from quill.frontend.tokenizer import Tokenizer

    return Tokenizer.load(default_dir)


@pytest.mark.parametrize("length", [1, 2, 3, 17, 256, 2048])
def test_random_prompts_encode_to_exactly_the_length_asked(prompts, server_tokenizer, length):
    rng = random.Random(length)
    for _ in range(3 if length < 2048 else 2):
        text = prompts.make(length, rng)
        assert len(server_tokenizer.encode(text)) == length  # with special tokens, as served


def test_prompts_leave_out_special_tokens(prompts, server_tokenizer):
    special = {
        i for i, t in server_tokenizer.hf.added_tokens_decoder.items() if t.special
    }  # e.g. <|im_start|>, <|endoftext|>
    assert special and special.isdisjoint(prompts.vocab)
    text = prompts.make(500, random.Random(0))
    assert special.isdisjoint(server_tokenizer.encode(text))


def test_random_requests_repeat_with_a_seed_and_differ_without(prompts, server_tokenizer):
    spec_in, spec_out = LengthSpec.parse("5:40"), LengthSpec.parse("3:9")
    a = random_requests(8, spec_in, spec_out, prompts, seed=4)
    assert a == random_requests(8, spec_in, spec_out, prompts, seed=4)
    for r in a:
        assert 5 <= r.prompt_len <= 40 and 3 <= r.output_len <= 9
        assert len(server_tokenizer.encode(r.prompt)) == r.prompt_len
    assert len({r.prompt_len for r in a}) > 1  # lengths really are drawn
    # No --seed: each run draws its own seed, so its prompts share nothing with another's.
    s1, s2 = resolve_seed(None), resolve_seed(None)
    assert s1 != s2
    fixed = LengthSpec(16, 16)
    b = random_requests(4, fixed, fixed, prompts, s1)
    c = random_requests(4, fixed, fixed, prompts, s2)
    assert not {r.prompt for r in b} & {r.prompt for r in c}
    assert resolve_seed(123) == 123


def test_random_prefix_is_shared_token_for_token(prompts, server_tokenizer):
    fixed, out = LengthSpec(40, 40), LengthSpec(4, 4)
    requests = random_requests(6, fixed, out, prompts, seed=9, prefix_len=100)
    encoded = [server_tokenizer.encode(r.prompt) for r in requests]
    assert all(len(ids) == r.prompt_len == 140 for ids, r in zip(encoded, requests))
    assert all(ids[:100] == encoded[0][:100] for ids in encoded)  # the prefix, exactly
    assert len({tuple(ids[100:]) for ids in encoded}) == 6  # the rest, each its own


# -- dataset files ----------------------------------------------------------------------------
def _words(text: str) -> int:
    return len(text.split())


SHAREGPT = [
    {
        "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "what is two plus two"},
            {"from": "gpt", "value": "it is four"},
            {"from": "human", "value": "and three"},
            {"from": "gpt", "value": "six words would be too many"},
        ]
    },
    {"conversations": [{"from": "gpt", "value": "no question was asked"}]},  # skipped
    {"conversations": [{"from": "human", "value": "hello"}]},  # no reply
]


def test_sharegpt_first_human_turn_and_first_reply(tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    entries = read_dataset(path)
    assert entries == [
        DatasetEntry("what is two plus two", reply="it is four"),
        DatasetEntry("hello"),
    ]
    # Output length = the reply's tokens ("it is four": 3 words); "hello" has no reply to
    # measure and is left out unless the run sets the output length.
    out = sample_requests(entries, 2, None, 0, count_prompt=_words, count_reply=_words)
    assert [(r.prompt, r.prompt_len, r.output_len) for r in out] == [
        ("what is two plus two", 5, 3)
    ] * 2
    out = sample_requests(entries, 2, LengthSpec(7, 7), 0, _words, _words)
    assert sorted((r.prompt, r.output_len) for r in out) == [
        ("hello", 7), ("what is two plus two", 7)
    ]  # fmt: skip


def test_jsonl_prompts_with_and_without_output_len(tmp_path):
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "a b c", "output_len": 4},
        {"prompt": "d e"},
        {"prompt": "f", "output_len": 9},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    entries = read_dataset(path)
    assert entries == [DatasetEntry("a b c", 4), DatasetEntry("d e"), DatasetEntry("f", 9)]
    out = sample_requests(entries, 5, None, seed=3, count_prompt=_words, count_reply=_words)
    # "d e" has no length: two usable entries, shuffled then repeated to make 5.
    pairs = [(r.prompt, r.prompt_len, r.output_len) for r in out]
    assert set(pairs) == {("a b c", 3, 4), ("f", 1, 9)}
    assert pairs[:2] == pairs[2:4] and pairs[0] == pairs[4] and pairs[0] != pairs[1]
    assert out == sample_requests(entries, 5, None, 3, _words, _words)
    with pytest.raises(ValueError, match="--output-len"):
        sample_requests([DatasetEntry("d e")], 1, None, 0, _words, _words)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ('{"prompt": "ok"}\n{"prompt": 5}\n', "line 2"),
        ('{"prompt": "ok"}\n\n[1]\n', "line 3"),
        ('{"prompt": "ok", "output_len": 0}\n', "line 1"),
        ('{"text": "no prompt"}\n', "line 1"),
        ('[{"conversations": [{"from": "human"}]}]', "record 1"),
        ("{not json\n", "line 1"),
    ],
)
def test_bad_dataset_records_are_named(tmp_path, text, where):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError, match=where):
        read_dataset(path)
