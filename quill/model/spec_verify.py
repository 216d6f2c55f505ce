"""Verifying drafted tokens in one pass (speculative decoding): given the
target's processed probabilities at every drafted position and one more, keep the longest run
of drafts the target accepts and choose one token after it, so that what comes out is
distributed exactly as if the target had sampled token by token.

Greedy rows accept a draft while it is the argmax. Sampled rows accept draft d at a position
with probability p(d) (rejection sampling against a point-mass proposal: q(d) = 1), and on the
first rejection draw from the residual max(0, p - q), which is p without d; when every draft is
accepted the extra position's p gives the bonus token. All rows at once, as tensor operations;
the randomness comes in as tensors so the caller (the sampler) keeps per-request generators.
"""

from __future__ import annotations

import torch


def verify_drafts(
    probs: torch.Tensor,
    drafts: torch.Tensor,
    num_drafts: torch.Tensor,
    greedy: torch.Tensor,
    uniform: torch.Tensor,
    noise: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """probs [rows, K + 1, vocab] (each row's distributions after its drafts 0..K-1, and the one
    after them all); drafts [rows, K] (padding past num_drafts is ignored); num_drafts [rows];
    greedy [rows] bool; uniform [rows, K] in [0, 1); noise [rows, vocab] ~ Exp(1).
    Returns (accepted drafts per row, the token after them)."""
    rows, k = drafts.shape
    if k == 0:
        return num_drafts.new_zeros(rows), _draw(probs[:, 0], greedy, noise)
    drafted = probs[:, :k]
    p_draft = drafted.gather(2, drafts.unsqueeze(2)).squeeze(2)
    accept = torch.where(greedy.unsqueeze(1), drafted.argmax(2) == drafts, uniform < p_draft)
    accept &= torch.arange(k, device=drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    num_accepted = accept.long().cumprod(1).sum(1)
    p_next = probs[torch.arange(rows, device=probs.device), num_accepted]
    rejected = num_accepted < num_drafts
    # The residual of a point mass: p with the rejected draft taken out (argmax of p / E draws
    # from it without normalising). A residual with nothing left (p(d) was 1 to rounding) keeps p.
    at = drafts.gather(1, num_accepted.clamp(max=k - 1).unsqueeze(1)).squeeze(1)
    residual = p_next.scatter(1, at.unsqueeze(1), 0.0)
    usable = rejected & (residual.sum(1) > 0)
    p_next = torch.where(usable.unsqueeze(1), residual, p_next)
    return num_accepted, _draw(p_next, greedy, noise)


def accept_greedy(
    targets: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy rows only: targets [rows, K + 1] (each position's argmax). Returns (accepted
    drafts per row: the run equal to the targets, the token after them: the target there)."""
    k = drafts.shape[1]
    same = targets[:, :k] == drafts
    same &= torch.arange(k, device=drafts.device).unsqueeze(0) < num_drafts.unsqueeze(1)
    num_accepted = same.long().cumprod(1).sum(1)
    rows = torch.arange(targets.shape[0], device=targets.device)
    return num_accepted, targets[rows, num_accepted]


def _draw(p: torch.Tensor, greedy: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return torch.where(greedy, p.argmax(1), (p / noise).argmax(1))
