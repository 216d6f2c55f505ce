"""Each routing policy's choice on scripted replica states (quill/router/policies.py)."""

from __future__ import annotations

import hashlib

import pytest

from quill.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from quill.router.instances import Instance
from quill.router.kv_index import EXPECT_S, ReplicaBlocks, events_address
from quill.router.policies import CacheAware, CacheAwareSettings, LeastLoad, RoundRobin
from quill.router.prompt_blocks import prefix_hashes


def replica(name: str, running=0, waiting=0, sent=0, held=()) -> Instance:
    r = Instance(f"http://{name}", "whole", running=running, waiting=waiting, num_sent=sent)
    r.blocks.held = set(held)
    r.blocks.has_events = True
    return r


H = [hashlib.sha256(bytes([i])).digest() for i in range(10)]  # a prompt of 10 blocks


def test_load_is_vllms_rule():
    assert replica("a", running=3, waiting=2).load == 2 * 4 + 3
    assert replica("a", running=3, waiting=2, sent=1).load == 3 * 4 + 3  # sent: waiting


def test_round_robin_and_least_load():
    rs = [replica("a", running=5), replica("b"), replica("c", waiting=1)]
    rr = RoundRobin()
    assert [rr.choose(rs, H, 0).url for _ in range(4)] == [
        "http://a", "http://b", "http://c", "http://a",
    ]  # fmt: skip
    assert LeastLoad().choose(rs, H, 0).url == "http://b"


def test_cache_aware_follows_the_longest_cached_prefix():
    policy = CacheAware()
    a = replica("a", running=2, held=H[:8])
    b = replica("b", running=1, held=H[:2])
    assert policy.choose([a, b], H, 0) is a and policy.last_reason == "cached"
    # Only the leading blocks count: a chain broken at block 0 matches nothing.
    c = replica("c", held=H[1:])
    assert c.matched(H, 0) == 0
    # Too little cached anywhere (below 30% of the prompt): by load.
    a.blocks.held = set(H[:2])
    assert policy.choose([a, b], H, 0) is b and policy.last_reason == "uncached"
    # Equal prefixes: the less loaded.
    b.blocks.held = set(H[:2])
    assert CacheAware(CacheAwareSettings(cache_threshold=0.1)).choose([a, b], H, 0) is b


def test_cache_aware_yields_to_load_when_out_of_balance():
    policy = CacheAware(CacheAwareSettings(balance_abs=16, balance_rel=1.5))
    hot = replica("hot", running=4, waiting=5, held=H)  # load 24
    cold = replica("cold", running=1)  # load 1: 23 apart, 24x
    assert policy.choose([hot, cold], H, 0) is cold and policy.last_reason == "imbalanced"
    # Apart by more than the absolute threshold but not the relative one: balanced.
    hot2 = replica("hot", running=40, held=H)
    warm = replica("warm", running=30)
    assert policy.choose([hot2, warm], H, 0) is hot2
    # A request without blocks (not rendered): by load.
    assert policy.choose([hot2, warm], [], 0) is warm and policy.last_reason == "no blocks"


def test_expected_blocks_until_events_say_otherwise():
    blocks = ReplicaBlocks()
    blocks.has_events = True
    blocks.expect(H[:4], now=100.0)
    assert blocks.matched(H, 100.0) == 4
    assert blocks.matched(H, 100.0 + EXPECT_S + 1) == 0  # expired: never confirmed
    blocks.expect(H[:4], now=200.0)
    blocks.apply([BlockStored(H[:3], None, list(range(48)), 16, None, None, None)])
    blocks.apply([BlockRemoved([H[1]], None)])
    assert blocks.matched(H, 200.0) == 1  # removed: the chain breaks at block 1
    blocks.apply([AllBlocksCleared()])
    assert blocks.matched(H, 200.0) == 0


def test_prefix_hashes_are_the_engines():
    from quill.contract.sampling_params import SamplingParams
    from quill.engine.kv_cache import KVCacheManager
    from quill.engine.request import Request

    tokens = list(range(7, 60))
    kv = KVCacheManager(16, 16, enable_prefix_caching=True)
    req = Request("r", tokens, SamplingParams(max_tokens=1), 0.0, 0)
    assert prefix_hashes(tokens, 16) == kv.block_hashes(req, len(tokens) // 16)


@pytest.mark.parametrize(
    "url,endpoint,expected",
    [
        ("http://10.0.0.5:8000", "tcp://*:5557", "tcp://10.0.0.5:5557"),
        ("http://host:8000", "tcp://0.0.0.0:6000", "tcp://host:6000"),
        ("http://host:8000", "tcp://127.0.0.1:6000", "tcp://127.0.0.1:6000"),
    ],
)
def test_events_address(url, endpoint, expected):
    assert events_address(url, endpoint) == expected
