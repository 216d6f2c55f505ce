"""The scheduler's decision as a step plan's entries: plain data, the only thing that crosses
from the engine core to its executor (quill/contract/plan.py). Once per scheduled request per
step, so kept lean: most sequences take the positional fast path."""

from __future__ import annotations

from collections.abc import Callable

from quill.contract.plan import KVFetch, SeqPlan
from quill.engine.prompt_scoring import prompt_tokens_to_score
from quill.engine.request import Request
from quill.engine.scheduler import ScheduledRequest


def seq_plans(
    scheduled: list[ScheduledRequest],
    tables: dict[str, list[list[int]]],
    copy_tables: bool,
    token_mask: Callable[[Request], bytes | None],
) -> list[SeqPlan]:
    """Each scheduled request's entry: its tokens, block tables (copied where `copy_tables`:
    they grow later), sampling and what its rows give (prompt logprobs, pooling)."""
    seqs = []
    append = seqs.append
    for s in scheduled:  # once per scheduled request per step: kept lean
        request = s.request
        start = s.start
        samples = s.samples
        drafts = s.draft_token_ids
        n_prompt = len(request.prompt_token_ids)
        if drafts:  # the last token, then the guesses after it
            token_ids = request.token_ids_slice(start, start + 1) + drafts
        elif s.num_tokens == 1 and start >= n_prompt:  # a decode: its last token
            token_ids = [request.output_token_ids[start - n_prompt]]
        else:
            token_ids = request.token_ids_slice(start, start + s.num_tokens)
        rid = request.request_id
        own = request.sampling_params
        # Copied: the tables grow later. An executor that never reads them (the
        # simulator's) gets the scheduler's own.
        block_tables = [t[:] for t in tables[rid]] if copy_tables else tables[rid]
        params = own if samples else None
        if own.is_plain and request.prompt_logprobs is None:  # most sequences: no
            # history, mask, scored prompt tokens or pooling (positional: it is faster)
            seq = SeqPlan(rid, token_ids, start, n_prompt, block_tables, samples, params)
            seq.draft_token_ids = drafts
            append(seq)
            continue
        history = samples and params.uses_penalties
        pooling = own.pooling
        scored = None
        if request.prompt_logprobs is not None:
            scored = prompt_tokens_to_score(request, start, s.num_tokens)
        append(
            SeqPlan(
                rid,
                token_ids,
                start,
                n_prompt,
                block_tables,
                samples,
                params,
                request.prompt_token_ids if history else None,
                request.output_token_ids[:] if history else None,
                token_bitmask=token_mask(request) if samples else None,
                draft_token_ids=drafts,
                prompt_logprob_token_ids=scored,
                prompt_logprobs=request.sampling_params.prompt_logprobs if scored else 0,
                pooling=_pooling(request, start, s.num_tokens),
                pool_logit_ids=_logit_ids(request),
                pool_classify=pooling is not None and pooling.classify,
                second_segment=None if pooling is None else pooling.second_segment,
            )
        )
    return seqs


def kv_fetches(fetching: list[Request], tables: dict[str, list[list[int]]]) -> list[KVFetch]:
    """The fetches that start with this plan: each request's blocks and where its KV is."""
    fetches = []
    for request in fetching:
        rid = request.request_id
        fetches.append(KVFetch(rid, tables[rid][0][:], request.remote_kv))  # one group
        request.remote_kv = None  # its fetch starts with this plan
    return fetches


def _pooling(request: Request, start: int, num_tokens: int) -> str | None:
    """What a chunk's rows give a pooling request: every chunk feeds a mean, the first the
    first row, the one that ends the prompt its last row."""
    pooling = request.sampling_params.pooling
    if pooling is None:
        return None
    kind = pooling.type
    if kind == "mean" or (kind == "cls" and start == 0):
        return kind
    if kind == "last" and start + num_tokens == len(request.prompt_token_ids):
        return kind
    return None


def _logit_ids(request: Request) -> list[int] | None:
    pooling = request.sampling_params.pooling
    return None if pooling is None or pooling.logit_ids is None else list(pooling.logit_ids)
