"""Paged attention against a plain per-sequence reference on random paged layouts.

Mixed decodes and prompt chunks, cached contexts, shuffled block tables with spare blocks,
padding tokens, and the single-chunk causal path; both the eager function and the custom op
that compiled models call.
"""

from __future__ import annotations

import random

import pytest
import torch

from quill.engine.plan import SeqPlan
from quill.model.attention import AttentionLayout, _paged_attention, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4
NUM_BLOCKS = 64


def reference(q, keys, values, start):
    """Query i sits at position start + i and sees keys 0 .. start + i (float64)."""
    group = HEADS // KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(q.shape[0]):
        visible = start + i + 1
        for h in range(HEADS):
            kh, vh = keys[:visible, h // group], values[:visible, h // group]
            weights = torch.softmax((kh @ q[i, h]) * HEAD_DIM**-0.5, dim=0)
            out[i, h] = weights @ vh
    return out


def random_step(rng: random.Random, q_lens: list[int], starts: list[int], padding: int):
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    k_cache = torch.randn(NUM_BLOCKS + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    v_cache = torch.randn(NUM_BLOCKS + 1, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    seqs, history = [], []
    for n, (q_len, start) in enumerate(zip(q_lens, starts)):
        total = start + q_len
        num_blocks = -(-total // BLOCK) + rng.choice([0, 0, 1])  # sometimes a spare block
        table = [free.pop() for _ in range(num_blocks)]
        cached = [k_cache[table[p // BLOCK], p % BLOCK].clone() for p in range(start)]
        cached_v = [v_cache[table[p // BLOCK], p % BLOCK].clone() for p in range(start)]
        seqs.append(SeqPlan(f"r{n}", [0] * q_len, start, total, table, samples=True))
        history.append((cached, cached_v))
    order = sorted(range(len(seqs)), key=lambda i: q_lens[i] > 1)  # decodes first
    seqs = [seqs[i] for i in order]
    history = [history[i] for i in order]
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens + padding, HEADS, HEAD_DIM, dtype=torch.float64)
    k = torch.randn(num_tokens + padding, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    v = torch.randn(num_tokens + padding, KV_HEADS, HEAD_DIM, dtype=torch.float64)
    slots = [
        s.block_table[p // BLOCK] * BLOCK + p % BLOCK
        for s in seqs
        for p in range(s.start, s.start + len(s.token_ids))
    ] + [NUM_BLOCKS * BLOCK] * padding
    expected = torch.zeros_like(q)
    row = 0
    for s, (cached, cached_v) in zip(seqs, history):
        n = len(s.token_ids)
        keys = torch.stack(cached + list(k[row : row + n]))
        values = torch.stack(cached_v + list(v[row : row + n]))
        expected[row : row + n] = reference(q[row : row + n], keys, values, s.start)
        row += n
    layout = AttentionLayout(KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS, torch.float64, q.device)
    meta = layout.build(seqs, torch.tensor(slots))
    return q, k, v, (k_cache, v_cache), meta, expected


CASES = {
    "decodes only": ([1, 1, 1, 1], [5, 17, 0, 30]),
    "one prompt, no context (causal path)": ([9], [0]),
    "decodes and a first chunk (causal path)": ([1, 1, 7], [3, 12, 0]),
    "a later chunk over cached context": ([6], [10]),
    "mixed decodes and chunks": ([1, 5, 1, 3, 8], [21, 0, 2, 13, 4]),
    "chunks of different lengths": ([2, 9, 4], [0, 7, 16]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("padding", [0, 3])
def test_matches_reference(case, padding):
    q_lens, starts = CASES[case]
    q, k, v, cache, meta, expected = random_step(random.Random(case), q_lens, starts, padding)
    out = paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5)
    torch.testing.assert_close(out, expected)
    # The cache now holds the step's keys at their slots.
    flat = cache[0].view(-1, KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat[meta.slot_mapping[: sum(q_lens)]], k[: sum(q_lens)])


def test_random_layouts():
    rng = random.Random(7)
    for _ in range(25):
        n = rng.randint(1, 6)
        q_lens = [rng.choice([1, 1, rng.randint(2, 12)]) for _ in range(n)]
        starts = [rng.randint(0, 25) for _ in range(n)]
        q, k, v, cache, meta, expected = random_step(rng, q_lens, starts, rng.choice([0, 2]))
        torch.testing.assert_close(paged_attention(q, k, v, cache, meta, HEAD_DIM**-0.5), expected)


def test_custom_op_matches_eager():
    q, k, v, cache, meta, expected = random_step(random.Random(1), [1, 4, 1, 6], [9, 0, 3, 5], 2)
    args = (
        meta.key_buffer,
        meta.value_buffer,
        meta.slot_mapping,
        meta.decode_tables,
        meta.decode_bias,
        meta.prefill_index,
        meta.prefill_rows,
        meta.prefill_tables,
        meta.prefill_bias,
        HEAD_DIM**-0.5,
    )
    out = torch.ops.quill.paged_attention(q, k, v, cache[0], cache[1], *args)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(_paged_attention(q, k, v, cache[0], cache[1], *args), expected)
