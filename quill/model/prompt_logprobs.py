"""Scoring prompt tokens: each one's logprob given the tokens before it, its rank, the top n.

A request that asks for prompt logprobs (an evaluation harness scoring choices, a perplexity
run) needs the output head on every prompt row, not only on the last one: [rows, vocab] logits
that for a long chunk would be hundreds of megabytes at once. They are made and reduced in
slabs of rows, so a chunk's scoring costs the head's arithmetic and a bounded buffer. The
log-softmax is never materialised: one native pass over each row (quill/ops/fused.py `score`)
gives the token's logprob and rank and the top 1; a top n > 1 comes from the logits less the
logsumexp.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from quill.contract.plan import PromptLogprob
from quill.ops import fused

# The most logits one slab holds (float32 bytes): large enough for the head's matmul to run
# at speed, small enough to stay in a few tens of megabytes whatever the chunk's length.
_SLAB_BYTES = 64 << 20


def score_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    num_top: int,
    vocab_size: int,
) -> list[PromptLogprob]:
    """Per row of `hidden` (the last layer's output at a prompt position): the logprob of the
    token in `targets` that follows it, that token's rank (1: the most likely) and the
    `num_top` most likely tokens with their logprobs."""
    slab = max(1, _SLAB_BYTES // (4 * vocab_size))
    chosen, ranks, top_ids, top_vals = [], [], [], []
    for begin in range(0, hidden.shape[0], slab):
        # The head's logits as they are (a NaN from a broken model shows as a null logprob).
        logits = compute_logits(hidden[begin : begin + slab])
        rows = targets[begin : begin + slab]
        scores = fused.score(logits, rows)
        chosen.append(scores.logprob)
        ranks.append(scores.rank)
        if num_top == 1:  # the scoring pass found it (lm-evaluation-harness asks for the top 1)
            top_ids.append(scores.best[:, None])
            top_vals.append(scores.best_logprob[:, None])
        elif num_top:
            # The row's logsumexp, from the token's logit and its logprob.
            lse = logits.gather(1, rows[:, None]).float() - scores.logprob[:, None]
            values, ids = logits.topk(num_top, dim=-1)
            top_ids.append(ids)
            top_vals.append(values.float() - lse)
    lps = torch.cat(chosen).tolist()
    rank_list = torch.cat(ranks).tolist()
    if not num_top:
        return [(lp, rank, []) for lp, rank in zip(lps, rank_list)]
    ids_list = torch.cat(top_ids).tolist()
    vals_list = torch.cat(top_vals).tolist()
    return [
        (lp, rank, list(zip(i, v))) for lp, rank, i, v in zip(lps, rank_list, ids_list, vals_list)
    ]
