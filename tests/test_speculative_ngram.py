"""The n-gram proposer (quill/engine/speculative.py) against a plain reference written here
position by position, and vLLM's configuration dict checked key by key."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.config import SpeculativeConfig
from quill.engine.speculative import propose_ngram


def reference(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the most recent earlier occurrence
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []


def test_by_hand():
    # "a b c d ... a b" -> after the earlier "a b" came "c d e".
    assert propose_ngram([1, 2, 3, 4, 5, 9, 1, 2], 3, 2, 4) == [3, 4, 5]
    # The longest recurring suffix wins: "7 1 2" occurred before "8", "1 2" last before "3".
    assert propose_ngram([7, 1, 2, 8, 0, 1, 2, 3, 7, 1, 2], 2, 1, 3) == [8, 0]
    # The most recent occurrence of the same length wins.
    assert propose_ngram([1, 2, 5, 1, 2, 6, 1, 2], 1, 2, 2) == [6]
    # Fewer than k follow when the match ends near the end.
    assert propose_ngram([4, 4, 4], 5, 1, 2) == [4]
    assert propose_ngram([1, 2, 3], 4, 2, 3) == []  # nothing recurs
    assert propose_ngram([5], 4, 1, 3) == [] and propose_ngram([], 4, 1, 3) == []


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(0, 4), max_size=60),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 3),
)
def test_matches_the_plain_reference(tokens, k, n_min, extra):
    n_max = n_min + extra
    assert propose_ngram(tokens, k, n_min, n_max) == reference(tokens, k, n_min, n_max)


def test_config_is_vllms_dict():
    c = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4}
    )  # fmt: skip
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (4, 2, 4)
    assert propose_ngram([1, 2, 3, 1, 2], 4, c.prompt_lookup_min, c.prompt_lookup_max) == [3, 1, 2]
    one = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4}
    )
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (4, 4)
    low = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2}
    )
    assert (low.prompt_lookup_min, low.prompt_lookup_max) == (2, 2)
    none = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 1})
    assert (none.prompt_lookup_min, none.prompt_lookup_max) == (5, 5)


@pytest.mark.parametrize(
    "config, names",
    [
        ({"method": "eagle", "num_speculative_tokens": 4}, "method"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
          "prompt_lookup_max": 2}, "below prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "speculative_model": "x"},
         "speculative_model"),
        ([1, 2], "JSON object"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(config, names):
    with pytest.raises(ValueError, match=names):
        SpeculativeConfig.from_dict(config)
