"""KV-cache events against the block pool's own changes, and block hashes from tokens alone."""

from __future__ import annotations

import hashlib
import random
import struct

import msgspec
import pytest

from quill import SamplingParams
from quill.config import EngineConfig, KVEventsConfig
from quill.contract.plan import StepPlan, StepResult
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventLog,
    decode_batch,
    encode_batch,
)
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler

BLOCK = 4


def documented_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list:
    """The hashes as quill/engine/kv_events.py documents them, written from the text alone."""
    parent = b"" if salt is None else hashlib.sha256(b"quill-cache-salt:" + salt.encode()).digest()
    out = []
    for i in range(len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{len(block)}q", *block)).digest()
        out.append(parent)
    return out


class _Executor:
    def __init__(self, clock: VirtualClock, rng: random.Random) -> None:
        self.clock, self.rng = clock, rng

    def execute(self, plan: StepPlan) -> StepResult:
        self.clock.advance(0.01)
        return StepResult({s.request_id: [self.rng.randrange(50)] for s in plan.seqs if s.samples})


class _Subscriber:
    """What a router knows of one replica: the blocks it holds, from the events alone."""

    def __init__(self) -> None:
        self.blocks: set[bytes] = set()
        self.tokens: dict[bytes, list[int]] = {}
        self.parents: dict[bytes, bytes | None] = {}

    def apply(self, batch: KVEventBatch) -> None:
        for event in batch.events:
            if isinstance(event, AllBlocksCleared):
                self.blocks.clear()
            elif isinstance(event, BlockStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                parent = event.parent_block_hash
                for i, h in enumerate(event.block_hashes):
                    assert h not in self.blocks, "stored twice without a removal between"
                    self.blocks.add(h)
                    self.tokens[h] = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                    self.parents[h] = parent
                    parent = h
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    assert h in self.blocks, "removed a block never stored"
                    self.blocks.discard(h)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_events_follow_the_pool_under_random_traffic(seed):
    rng = random.Random(seed)
    clock = VirtualClock()
    kv = KVCacheManager(40, BLOCK, enable_prefix_caching=True)
    kv.pool.events = log = KVEventLog(BLOCK)
    core = EngineCore(Scheduler(kv, 32, 8, 256), _Executor(clock, rng), clock)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 30))] for _ in range(6)]
    view = _Subscriber()
    view.blocks = {b"what a router knew of an earlier engine"}  # a fresh one clears it first
    salts = [None, None, None, "tenant-a"]
    for step in range(400):
        if rng.random() < 0.3:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 12))]
            params = SamplingParams(max_tokens=rng.randrange(1, 16), ignore_eos=True)
            req = Request(f"r{step}", prompt, params, clock.now(), 49)
            req.cache_salt = rng.choice(salts)
            core.add_request(req)
        core.step()
        batch = KVEventBatch(clock.now(), log.drain())
        view.apply(decode_batch(encode_batch(batch)))  # through the wire format
        held = {h for h in kv.pool.cached if len(h) == 32}
        assert view.blocks == held, f"step {step}"
    assert kv.pool.num_evictions > 0, "no eviction: the test saw no BlockRemoved"
    # Each stored block's hash is recomputable from its tokens and its parent's hash.
    for h, tokens in view.tokens.items():
        parent = view.parents[h] or b""
        assert hashlib.sha256(parent + struct.pack(f"<{BLOCK}q", *tokens)).digest() == h


def test_hashes_from_tokens_equal_the_engines():
    kv = KVCacheManager(64, BLOCK, enable_prefix_caching=True)
    kv.pool.events = log = KVEventLog(BLOCK)
    prompt = list(range(100, 123))
    for rid, salt in (("plain", None), ("salted", "s")):
        req = Request(rid, prompt, SamplingParams(max_tokens=1), 0.0, 0)
        req.cache_salt = salt
        assert kv.allocate_slots(req, len(prompt))
        kv.cache_blocks(req, len(prompt))
        assert req.block_hashes == documented_hashes(prompt, BLOCK, salt)
    events = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in events] == [
        documented_hashes(prompt, BLOCK),
        documented_hashes(prompt, BLOCK, "s"),
    ]
    assert events[0].parent_block_hash is None
    assert events[1].parent_block_hash == hashlib.sha256(b"quill-cache-salt:s").digest()


# vLLM 0.34's structs (vllm/distributed/kv_events.py), declared again here as vLLM declares
# them (a few of its optional fields included: a decoder with more fields reads our events).
class _VBase(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(_VBase, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class VBlockRemoved(_VBase, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(_VBase, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_wire_format_is_vllms():
    """vLLM's decoder reads our bytes."""

    h = documented_hashes(list(range(8)), BLOCK)
    ours = KVEventBatch(
        1.5,
        [
            AllBlocksCleared(),
            BlockStored(h, None, list(range(8)), BLOCK, None, None, None),
            BlockRemoved(h, None),
        ],
        3,
    )
    theirs = msgspec.msgpack.Decoder(VBatch).decode(encode_batch(ours))
    assert theirs.ts == 1.5 and theirs.data_parallel_rank == 3
    stored = theirs.events[1]
    assert (stored.block_hashes, stored.token_ids, stored.block_size) == (h, list(range(8)), 4)
    assert isinstance(theirs.events[2], VBlockRemoved) and theirs.events[2].block_hashes == h
    # On the wire: the batch an array, each event a map tagged with its type.
    raw = msgspec.msgpack.decode(encode_batch(ours))
    assert raw[0] == 1.5 and raw[2] == 3
    assert raw[1][1]["type"] == "BlockStored" and raw[1][1]["block_size"] == 4


def test_config_is_vllms_json():
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true, "topic": "kv"}')
    assert (config.publisher, config.endpoint, config.replay_endpoint) == (
        "zmq",
        "tcp://*:5557",
        None,
    )
    ranked = EngineConfig(
        kv_events_config={
            "enable_kv_cache_events": True,
            "endpoint": "tcp://*:6000",
            "replay_endpoint": "tcp://*:6100",
        },
        data_parallel_rank=2,
    ).kv_events
    assert (ranked.endpoint, ranked.replay_endpoint) == ("tcp://*:6002", "tcp://*:6102")
    assert EngineConfig(kv_events_config={"enable_kv_cache_events": False}).kv_events is None
    with pytest.raises(ValueError, match="unknown key"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "endpont": "x"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.parse({"enable_kv_cache_events": True, "publisher": "kafka"})
