"""Speculative decoding's engine side: its configuration, n-gram prompt lookup, and the switch
that turns it on only where the cost model says it pays. Torch-free, on token ids.

A reply that repeats its input (an edit, a summary quoting its text, code) has runs that already
occur in the sequence: if the last n tokens occurred before, the tokens that followed them then
are a cheap guess of the next ones. The scheduler gives a decoding request those guesses as
drafts; the model verifies them all in one pass (quill/model/spec_verify.py) and the request
keeps the accepted run plus one token. The configuration is vLLM's `speculative_config` dict
(`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
"prompt_lookup_max": 4}`), validated here with errors naming the key.

Drafts pay only while a pass is movement-bound: five tokens a sequence cost little more than one
when the weights' read dominates, and nearly five times as much once the batch makes the pass
arithmetic-bound. `SpeculationSwitch` prices both passes each step and picks the number of
drafts that gives the most tokens per second, with the acceptance measured as it runs.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

METHODS = ("ngram",)
_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "by_cost"}
DEFAULT_LOOKUP = 5  # vLLM's n when neither bound is given


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int
    # quill's own key: speculate only where the cost model says it pays (false: whenever the
    # proposer finds drafts, as vLLM does).
    by_cost: bool = True

    @classmethod
    def parse(cls, value: dict | str) -> SpeculativeConfig:
        """The dict, or its JSON text (the command line's --speculative-config)."""
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON: {e}") from None
        return cls.from_dict(value)

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """vLLM's dict (plus quill's `by_cost`); one lookup bound given stands for both, neither
        means 5."""
        if not isinstance(d, dict):
            raise ValueError("speculative_config must be a JSON object")
        method = d.get("method")
        if method in ("draft_model", "eagle", "eagle3", "medusa", "mtp"):
            raise ValueError(
                f"speculative_config.method {method!r} is not built: quill proposes by n-gram "
                "lookup only. A draft model needs a smaller model of the target's tokenizer, "
                "and no two of the models quill loads share one (SmolLM2-135M: 49,152 tokens; "
                "Gemma 3 270M: 262,144)"
            )
        if method not in METHODS:
            raise ValueError(
                f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}"
            )
        unknown = sorted(set(d) - _KEYS)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}")
        k = _positive(d, "num_speculative_tokens", None)
        high = d.get("prompt_lookup_max")
        low = _positive(d, "prompt_lookup_min", high if high is not None else DEFAULT_LOOKUP)
        high = _positive(d, "prompt_lookup_max", low)
        if high < low:
            raise ValueError(
                f"speculative_config.prompt_lookup_max ({high}) is below prompt_lookup_min ({low})"
            )
        by_cost = d.get("by_cost", True)
        if not isinstance(by_cost, bool):
            raise ValueError(f"speculative_config.by_cost must be true or false, got {by_cost!r}")
        return cls(method, k, low, high, by_cost)

    def propose(self, token_ids: Sequence[int], k: int | None = None) -> list[int]:
        """Up to `k` (default num_speculative_tokens) drafts to follow `token_ids`."""
        k = self.num_speculative_tokens if k is None else k
        return propose_ngram(token_ids, k, self.prompt_lookup_min, self.prompt_lookup_max)


def _positive(d: dict, key: str, default: int | None) -> int:
    value = d.get(key, default)
    if value is None:
        raise ValueError(f"speculative_config.{key} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config.{key} must be a positive integer, got {value!r}")
    return value


def propose_ngram(token_ids: Sequence[int], k: int, n_min: int, n_max: int) -> list[int]:
    """Up to k tokens guessed to follow `token_ids`: for the longest n in [n_min, n_max] whose
    last n tokens occurred earlier, the tokens after the most recent such occurrence (recent
    text predicts the reply's next run best: a copy goes on from where it got to). [] when no
    suffix recurs. One vectorised comparison a length, no loop over positions."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    length = tokens.size
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        # Windows starting at 0 .. length - 1 - n: every occurrence but the suffix itself.
        windows = sliding_window_view(tokens[: length - 1], n)
        hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start : start + k].tolist()
    return []
