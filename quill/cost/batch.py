"""The shape of one step, reduced to the handful of counts its cost depends on.

The engine's plans, the simulator's and a person's "B prompts of l tokens" all become the same
BatchShape, so one pricing function serves them all and never needs torch or the engine.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BatchShape:
    """Counts for one pass. Attention is causal: a chunk of n tokens starting at position
    `start` attends to n*start + n*(n+1)//2 (query, key) pairs, and its sequence reads its
    whole context (start + n tokens) of KV cache once per layer. Under a sliding window of W
    keys, the query at position p sees min(p + 1, W) keys, and the chunk reads the last
    n - 1 + W of its context at most."""

    num_tokens: int
    num_seqs: int
    num_sampled: int
    num_prefill_tokens: int
    num_decode_tokens: int
    attention_pairs: int
    kv_tokens_read: int
    kv_tokens_written: int

    @classmethod
    def from_seqs(
        cls, seqs: Iterable[tuple[int, int, bool | int, bool]], window: int | None = None
    ) -> BatchShape:
        """From (start, num_tokens, samples, is_decode) per scheduled sequence; `samples` may
        be the rows of logits it computes (a speculative decode: one per drafted position and
        one more), True being one."""
        tokens = seqs_n = sampled = prefill = decode = pairs = read = 0
        for start, n, samples, is_decode in seqs:
            if start < 0 or n < 1:
                raise ValueError(
                    f"a sequence needs start >= 0 and num_tokens >= 1, got {start}, {n}"
                )
            tokens += n
            seqs_n += 1
            sampled += int(samples)
            if is_decode:
                decode += n
            else:
                prefill += n
            pairs += _pairs(start, n, window)
            read += start + n if not window else min(start + n, n - 1 + window)
        return cls(tokens, seqs_n, sampled, prefill, decode, pairs, read, tokens)

    @classmethod
    def abstract(
        cls,
        prefill: Iterable[tuple[int, int]] = (),
        decode: Iterable[int] = (),
    ) -> BatchShape:
        """Prefill chunks as (chunk_tokens, cached_context), each sampling one token (the chunk
        ends its prompt); decodes as the context length before their one token, each sampling."""
        seqs = [(cached, n, True, False) for n, cached in prefill]
        seqs += [(context, 1, True, True) for context in decode]
        return cls.from_seqs(seqs)

    @classmethod
    def prefills(cls, batch: int, tokens: int, cached: int = 0) -> BatchShape:
        """`batch` identical prompt chunks of `tokens` after `cached` tokens, in O(1)."""
        if batch < 1 or tokens < 1 or cached < 0:
            raise ValueError(
                f"need batch >= 1, tokens >= 1, cached >= 0: {batch}, {tokens}, {cached}"
            )
        pairs = batch * (tokens * cached + tokens * (tokens + 1) // 2)
        total = batch * tokens
        return cls(total, batch, batch, total, 0, pairs, batch * (cached + tokens), total)

    @classmethod
    def decodes(cls, batch: int, context: int) -> BatchShape:
        """`batch` decodes, each one token after `context` tokens, in O(1)."""
        if batch < 1 or context < 0:
            raise ValueError(f"need batch >= 1 and context >= 0, got {batch}, {context}")
        per_seq = context + 1
        return cls(batch, batch, batch, 0, batch, batch * per_seq, batch * per_seq, batch)

    @classmethod
    def from_plan(cls, plan, window: int | None = None) -> BatchShape:
        """From the engine's StepPlan (duck-typed: `plan.seqs` items have start, num_tokens,
        samples, is_decode, and optionally draft_token_ids). Runs once per simulated step, so
        it is one plain loop."""
        if window:
            return cls.from_seqs(
                ((s.start, s.num_tokens, logits_rows(s), s.is_decode) for s in plan.seqs), window
            )
        tokens = sampled = decode = pairs = read = 0
        seqs = plan.seqs
        for s in seqs:
            start = s.start
            n = s.num_tokens
            tokens += n
            drafts = getattr(s, "draft_token_ids", None)
            if getattr(s, "prompt_logprob_token_ids", None) is None:  # logits_rows, inline
                if s.samples:
                    sampled += 1 + len(drafts) if drafts else 1
            else:
                sampled += logits_rows(s)
            if s.is_decode:
                decode += n
            pairs += n * start + (n * (n + 1) >> 1)
            read += start + n
        return cls(tokens, len(seqs), sampled, tokens - decode, decode, pairs, read, tokens)


def logits_rows(seq) -> int:
    """Rows of logits a plan's sequence computes: one per prompt token it scores, one per
    drafted position and one more when it samples (SeqPlan.num_logits, for duck-typed plans
    too)."""
    scored = getattr(seq, "prompt_logprob_token_ids", None)
    rows = len(scored) if scored else 0
    if not seq.samples:
        return rows
    drafts = getattr(seq, "draft_token_ids", None)
    return rows + (1 + len(drafts) if drafts else 1)


def _pairs(start: int, n: int, window: int | None) -> int:
    """(query, key) pairs of n queries at positions start .. start + n - 1, each seeing the
    keys up to itself, at most `window` of them: the sum of min(p + 1, window)."""
    if not window or start + n <= window:
        return n * start + n * (n + 1) // 2
    # m = p + 1 runs start + 1 .. start + n: those up to the window count m, the rest window.
    below = _sum_to(window) - _sum_to(start) if start < window else 0
    return below + (start + n - max(start, window)) * window


def _sum_to(m: int) -> int:
    return m * (m + 1) // 2
