"""Sliding-window layers give their blocks behind the window back to the pool, and the output
stays that of transformers on the same weights."""

from __future__ import annotations

import pytest
import torch

from quill import LLM, SamplingParams
from quill.contract.kv_groups import KVGroups, peak_blocks
from tests.conftest import random_checkpoint

BLOCK = 16
PROMPT = list(range(100, 250))  # 150 tokens, many windows (8 keys) long
REPLY = 40


def test_groups_of_equal_size_one_window_each():
    gemma_270m = KVGroups.of(([512] * 5 + [0]) * 3)
    assert gemma_270m.group_windows == (512,) * 5 + (0,)
    assert gemma_270m.layers_per_block == 3
    assert gemma_270m.layer_groups[:6] == (0, 0, 0, 1, 1, 5)
    assert gemma_270m.layer_slots[:6] == (0, 1, 2, 0, 1, 0)
    assert KVGroups.uniform(30).group_windows == (0,)
    mixed = KVGroups.of([4, 0, 4, 4, 0, 4])  # 4 sliding, 2 global: groups of 2
    assert mixed.group_windows == (4, 4, 0)
    assert mixed.layer_groups == (0, 2, 0, 1, 2, 1)
    # Hand-worked: 190 tokens = 12 blocks for the global group; the sliding one holds the
    # 32-token chunk and its 7 keys back, 39 tokens over at most 4 blocks.
    assert peak_blocks((8, 0), 190, 32, BLOCK) == 12 + 4


@pytest.mark.parametrize("kind", ["gemma3", "gemma3_reference"])  # native kernel, PyTorch path
def test_a_pool_too_small_without_the_release_serves_the_request_unchanged(tmp_path, kind):
    """One sliding layer (window 8) and one global: 2 groups of one layer. 16 blocks of one
    layer hold the 190 tokens' 12 global blocks and the sliding layer's few, where keeping
    both layers' 12 would need 24: the request only completes if blocks go back."""
    ref = random_checkpoint(tmp_path, kind, sharded=False)
    per_block = 2 * ref.config.num_key_value_heads * ref.config.head_dim * BLOCK * 4
    llm = LLM(
        str(tmp_path),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        block_size=BLOCK,
        max_num_batched_tokens=32,
        kv_cache_memory=16 * per_block,
        enable_prefix_caching=False,
    )
    kv = llm.engine.scheduler.kv
    assert kv.num_blocks == 16 and kv.group_windows == (8, 0)
    assert 2 * -(-(len(PROMPT) + REPLY) // BLOCK) > kv.num_blocks
    params = SamplingParams(max_tokens=REPLY, temperature=0, ignore_eos=True)
    out = llm.generate([PROMPT], params)[0].outputs[0]
    t = torch.tensor([PROMPT])
    with torch.inference_mode():
        expected = ref.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=REPLY,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    assert out.finish_reason == "length" and len(out.token_ids) == REPLY
    assert out.token_ids == expected[0, len(PROMPT) :].tolist()
    assert llm.engine.scheduler.num_preemptions == 0
    assert kv.pool.num_free_blocks == kv.num_blocks
