"""The simulator names its made-up prompts' blocks with Python's hash of ints, not SHA-256
(quill/sim/replica.made_up_block_hash): blocks must be equal exactly where SHA-256 makes them
equal, so that every figure of a run is the one the engine's own hash gives."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import quill.sim.replica
import quill.sim.routing
from quill.cost.model import ModelSpec
from quill.engine.kv_cache import chain_root, hash_block
from quill.sim.cluster import run_colocated
from quill.sim.replica import made_up_block_hash
from quill.sim.workload import LengthSpec, synthetic
from tests.test_sim_fast_forward import _config, _same

# Token values as the simulator makes them (prefix values 1, 2, ...; a request's own -2, -3,
# ...; replies 0) and as real prompts have them.
values = st.one_of(st.integers(-40, 40).filter(lambda v: v != -1), st.integers(0, 300_000))
chains = st.lists(st.lists(st.lists(values, min_size=4, max_size=4), max_size=6), max_size=6)


def _names(chain_of_blocks, hasher) -> list:
    parent, out = chain_root(None), []
    for block in chain_of_blocks:
        parent = hasher(parent, block)
        out.append(parent)
    return out


@settings(max_examples=300, deadline=None)
@given(chains, st.integers(0, 3))
def test_blocks_are_equal_exactly_where_sha256_says(chains, shared):
    # Chains that share their first blocks, as prompts with a common prefix do.
    chains = [chains[0][:shared] + c if chains else c for c in chains]
    sha = [h for c in chains for h in _names(c, hash_block)]
    ours = [h for c in chains for h in _names(c, made_up_block_hash)]
    for i in range(len(sha)):
        for j in range(len(sha)):
            assert (sha[i] == sha[j]) == (ours[i] == ours[j])


@pytest.mark.parametrize("router", [None, "cache-aware"])
def test_a_run_is_the_same_with_sha256(monkeypatch, router):
    """One shared prefix ending inside a block, on a pool small enough to evict and preempt:
    hits, evictions, preemptions and a cache-aware router's picks come out the same."""
    per_block = 16 * ModelSpec.preset("SmolLM2-135M", 2).kv_bytes_per_token
    config = _config(max_num_seqs=32, max_num_batched_tokens=512,
                     kv_cache_memory=400 * per_block)  # fmt: skip
    work = list(synthetic(200, 200.0, LengthSpec(20, 400), LengthSpec(1, 300), seed=3,
                          prefix_tokens=40))  # fmt: skip
    replicas = 1 if router is None else 3
    ours = run_colocated(config, work, replicas, None, router or "least-work")
    monkeypatch.setattr(quill.sim.replica, "made_up_block_hash", hash_block)
    monkeypatch.setattr(quill.sim.routing, "made_up_block_hash", hash_block)
    sha = run_colocated(config, work, replicas, None, router or "least-work")
    _same(ours, sha)
    assert sha["results"]["prefix_cache_hit_rate"] > 0.2
    assert sha["results"]["num_preemptions"] > 0
