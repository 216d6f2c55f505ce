"""The simulator's fast-forward (quill/sim/fast_forward.py) gives what the engine core's own
steps give: the same requests' times, the same steps, preemptions and prefix-cache hits, on
workloads that preempt, share prefixes, jitter and hand requests over; only faster."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.sim.cluster import run_colocated, run_disaggregated
from quill.sim.config import SimConfig
from quill.sim.workload import LengthSpec, synthetic
from tests.test_sim import TOY


def _config(memory=(0.6, 0.05), **kwargs) -> SimConfig:
    """Jittered steps; `memory`: the draws' (shared, seconds), None for independent draws."""
    model = ModelSpec.preset("SmolLM2-135M", 2)
    hardware = HardwareSpec(**{**TOY.to_dict(), "interconnect_bandwidth": 10e9})
    config = SimConfig.create(model, hardware, max_model_len=4096, **kwargs)
    ratios = tuple(0.8 + 0.6 * (i / 100) ** 3 for i in range(101))  # a long right tail
    decodes = tuple(0.9 + 0.3 * (i / 100) ** 4 for i in range(101))  # decode steps' own
    return replace(config, step_jitter=ratios, step_jitter_by_kind={"decode": decodes},
                   step_memory=memory, step_gap=(0.0004, 0.00003), seed=7)  # fmt: skip


def _workload(n=300, rate=40.0, prefix=0):
    return list(synthetic(n, rate, LengthSpec(20, 400), LengthSpec(1, 300), seed=3,
                          prefix_tokens=prefix, num_prefixes=5))  # fmt: skip


def _same(fast: dict, slow: dict) -> None:
    """Every figure equal (float ones to rounding: a request's ITL sum adds its gaps in
    another order); the step counts and the fast run's share of them apart."""
    assert fast.keys() == slow.keys()
    for key, value in slow.items():
        if isinstance(value, dict):
            _same(fast[key], value)
        elif isinstance(value, list):
            assert len(fast[key]) == len(value)
            for a, b in zip(fast[key], value):
                if isinstance(b, dict):
                    _same(a, b)
                else:
                    assert a == b, key
        elif isinstance(value, float) and not math.isnan(value):
            assert fast[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
        elif key != "fast_forwarded_steps":
            assert fast[key] == value, key


def _both(run, config, *args, **kwargs):
    slow = run(replace(config, fast_forward=False), *args, **kwargs)
    fast = run(config, *args, **kwargs)
    return fast, slow


@pytest.mark.parametrize(
    "rate, blocks, prefix",
    [(40.0, 1000, 0), (400.0, 600, 0), (400.0, 600, 96), (math.inf, 4000, 0)],
    ids=["light", "preempting", "preempting-prefixes", "full-batch-with-a-queue"],
)
def test_colocated_with_preemptions_and_prefixes(rate, blocks, prefix):
    # 64 sequences of up to 700 tokens: at 400 requests/s they outgrow a pool of 600 blocks.
    per_block = 16 * ModelSpec.preset("SmolLM2-135M", 2).kv_bytes_per_token
    config = _config(max_num_seqs=64, max_num_batched_tokens=512,
                     kv_cache_memory=blocks * per_block)  # fmt: skip
    fast, slow = _both(run_colocated, config, _workload(rate=rate, prefix=prefix))
    _same(fast, slow)
    steps = fast["replicas"][0]
    if blocks == 600:
        assert slow["results"]["num_preemptions"] > 100
        assert steps["fast_forwarded_steps"] > 100
    elif math.isinf(rate):  # all at once: 64 running, the rest waiting for a finish
        assert slow["results"]["num_preemptions"] == 0
        assert steps["fast_forwarded_steps"] > steps["steps"] * 0.3
    else:
        assert steps["fast_forwarded_steps"] > steps["steps"] * 0.8
    if prefix:
        assert slow["results"]["prefix_cache_hit_rate"] > 0.1


@pytest.mark.parametrize("router", ["least-work", "round-robin", "least-load"])
def test_replicas_behind_a_router(router):
    # Independent draws here (each other test's draws remember the level of the one before).
    config = _config(memory=None, max_num_seqs=32)
    fast, slow = _both(run_colocated, config, _workload(rate=80.0), 3, None, router)
    _same(fast, slow)
    assert sum(r["fast_forwarded_steps"] for r in fast["replicas"]) > 0


def test_a_cache_aware_router_sees_each_fast_forwarded_steps_events():
    """Shared prefixes on pools of 300 blocks: decode steps evict cached prefix blocks, and
    the router learns of each eviction from that step's KV-cache events, 0.3 s after the step
    ended, as if the core had run it (stamped at the run's end instead, routing differs)."""
    per_block = 16 * ModelSpec.preset("SmolLM2-135M", 2).kv_bytes_per_token
    config = _config(max_num_seqs=32, kv_cache_memory=300 * per_block)
    fast, slow = _both(run_colocated, config, _workload(rate=80.0, prefix=96), 3, None,
                       "cache-aware")  # fmt: skip
    _same(fast, slow)
    assert slow["results"]["prefix_cache_hit_rate"] > 0.3
    assert sum(r["fast_forwarded_steps"] for r in fast["replicas"]) > 1000
    assert sum(r["fast_forwarded_steps"] for r in fast["replicas"]) > 0


def test_disaggregated_hand_overs_and_fetches():
    # Prompts in chunks of 64: a prefill replica's steps that hand nothing over yet bound how
    # far a decode replica may run ahead (a later one may hand a request over before it).
    config = _config(max_num_seqs=32, max_num_batched_tokens=64)
    fast, slow = _both(run_disaggregated, config, _workload(rate=60.0), 1, 2)
    _same(fast, slow)
    assert sum(r["fast_forwarded_steps"] for r in fast["replicas"]) > 0


def test_a_lone_request_decodes_in_one_jump_at_its_prices():
    """100 tokens of reply after a 50-token prompt, nothing else: the prefill is the core's
    step, the 99 after it (the last one ending the request) one fast-forward; each step priced
    at its context."""
    config = replace(_config(), step_jitter=None, step_jitter_by_kind=None, step_gap=(0.001, 0.0))
    item = next(iter(synthetic(1, 1.0, LengthSpec(50, 50), LengthSpec(100, 100), seed=0)))
    out = run_colocated(config, [item])
    cost = config.cost
    from quill.cost.batch import BatchShape

    prefill = cost.price(BatchShape.from_seqs([(0, 50, True, False)])).predicted_s + 0.001
    decodes = [cost.price(BatchShape.decodes(1, 50 + i)).predicted_s + 0.001 for i in range(99)]
    assert out["results"]["ttft_ms"]["mean"] == pytest.approx(prefill * 1e3, rel=1e-12)
    assert out["results"]["e2e_ms"]["mean"] == pytest.approx((prefill + sum(decodes)) * 1e3,
                                                             rel=1e-12)  # fmt: skip
    assert out["replicas"][0]["steps"] == 100
    assert out["replicas"][0]["fast_forwarded_steps"] == 99


def test_a_fill_whose_content_a_grow_evicts_keeps_the_schedulers_order():
    """Blocks of 4 in a pool of 3. X's block [5, 5, 5, 5] is cached and free, next to be
    evicted. In one step A fills a block of the same content and B grows into that free
    block. The scheduler registers A's copy first (refused: the content is cached), then B's
    growth evicts X's: the content is cached nowhere after the step. Taking the step's blocks
    in one allocation first would let A's copy in: the fast-forward must see that and go in
    the scheduler's order."""
    from quill.contract.sampling_params import SamplingParams
    from quill.engine.kv_cache import KVCacheManager
    from quill.engine.request import Request
    from quill.sim.fast_forward import FILL, GROW, _blocks
    from quill.sim.replica import made_up_block_hash

    kv = KVCacheManager(3, 4, True, (0,), made_up_block_hash)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    x = Request("x", [5, 5, 5, 5], params, 0.0, 8)
    kv.allocate_slots(x, 4)
    kv.cache_blocks(x, 4)
    (content,) = x.block_hashes
    kv.free("x")  # cached and free: the next block the pool hands out after the fresh ones
    a = Request("a", [5, 5, 5], params, 0.0, 8)
    a.output_token_ids = [5]  # its next step writes position 3: the block [5, 5, 5, 5]
    b = Request("b", [7, 7, 7, 7], params, 0.0, 8)
    b.output_token_ids = [9]  # its next step writes position 4: a second block
    for r in (a, b):
        kv.allocate_slots(r, len(r.prompt_token_ids))
        r.num_computed_tokens = len(r.prompt_token_ids)
    assert kv.pool.num_free_blocks == 1 and kv.pool.lookup(content) is not None
    assert _blocks(kv, [a, b], [(0, FILL), (1, GROW)], 0)
    assert kv.pool.lookup(content) is None  # evicted, and A's copy never registered
    assert len(kv.block_table("b")) == 2 and kv.pool.num_free_blocks == 0
