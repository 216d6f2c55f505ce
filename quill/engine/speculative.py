"""Speculative decoding's proposer: n-gram prompt lookup, in the torch-free core, on token ids.

A reply that repeats its input (an edit, a summary quoting its text, code) has runs that already
occur in the sequence: if the last n tokens occurred before, the tokens that followed them then
are a cheap guess of the next ones. The scheduler gives a decoding request those guesses as
drafts; the model verifies them all in one pass (quill/model/spec_verify.py) and the request
keeps the accepted run plus one token. The configuration is vLLM's `speculative_config` dict
(`quill.config.SpeculativeConfig`).

Drafts pay only while a pass is movement-bound; quill/engine/spec_switch.py decides how many a
step may carry.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


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
