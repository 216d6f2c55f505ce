"""Prompt logprobs on the engine's side: which prompt tokens a chunk scores, and gathering them;
and a pooling request's chunks gathered into its embedding the same way.

A request that asks for its prompt's logprobs scores it chunk by chunk: the row at position p
of a chunk gives the logprob of prompt token p + 1. The core names those tokens in the plan
and appends what the executor returns to the request, which the worker sends with its first
update. No torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from quill.contract.pooling import add_pooled
from quill.engine.request import Request

if TYPE_CHECKING:
    from quill.engine.scheduler import SchedulerOutput


def prompt_tokens_to_score(request: Request, start: int, num_tokens: int) -> list[int] | None:
    """The prompt tokens a chunk at `start` scores: the row at each position p up to the
    prompt's last but one gives the logprob of token p + 1. None when the chunk reaches no
    position not yet scored (a preempted request recomputing what it scored before)."""
    prompt = request.prompt_token_ids
    end = min(start + num_tokens, len(prompt) - 1)
    if end <= max(start, len(request.prompt_logprobs)):
        return None
    return prompt[start + 1 : end + 1]


def gather_prompt_logprobs(sched: SchedulerOutput, scored: dict[str, list]) -> None:
    """Append each scoring request's new prompt logprobs (entry i of a chunk at `start` is
    prompt token start + 1 + i's; those it already has, rescored after a preemption, are
    dropped). A chunk never starts past what is scored: the prefix cache serves such a
    request no further (Request.num_reusable_tokens)."""
    for s in sched.scheduled:
        request = s.request
        entries = scored.get(request.request_id)
        if entries:
            have = request.prompt_logprobs
            if len(have) < s.start:
                raise RuntimeError(f"{request.request_id}: prompt logprobs skipped a position")
            have.extend(entries[len(have) - s.start :])


def gather_pooled(sched: SchedulerOutput, pooled: dict[str, tuple]) -> None:
    """Add each pooling request's chunk to what it has pooled. A chunk at position 0 starts
    over: a preempted request computes its prompt again from the start (mean and first-row
    pooling reuse no cached prefix, Request.num_reusable_tokens)."""
    for s in sched.scheduled:
        request = s.request
        chunk = pooled.get(request.request_id)
        if chunk is not None:
            kind = request.sampling_params.pooling.type
            total = None if s.start == 0 else request.pooled
            request.pooled = add_pooled(total, chunk, kind)
