"""KV-cache events: which prefix blocks this engine holds, told to routers as it changes.

Routers that send a request where its prompt is already cached (llm-d's precise prefix scorer,
Dynamo's KV router, SGLang's and vLLM's routers, `quill router --policy cache-aware`) learn each
replica's cache from these events, in vLLM's wire format (as of vLLM 0.34: a batch is a msgpack
array [ts, events, data-parallel rank], each event a map tagged "type"): a full
block registered in the prefix cache is `BlockStored`, one evicted or forgotten is
`BlockRemoved`, and `AllBlocksCleared` says the replica's cache is empty (a fresh engine sends
it first, so a subscriber drops what it knew of an earlier one).

Block hashes are quill's prefix-cache hashes (quill/engine/kv_cache.py), which a router can
recompute from the token ids alone, with no seed: the first block's hash is
SHA-256(int64 little-endian token ids), each next block's SHA-256(parent's 32-byte digest +
its int64 little-endian token ids), `block_size` tokens a block. A request with a
`cache_salt` starts its chain from SHA-256(b"quill-cache-salt:" + salt) instead of nothing.
Hashes travel as their 32 bytes (vLLM's `ExternalBlockHash` is bytes or int; vLLM itself
sends the digest's low 64 bits as an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0). Only
the first KV group's blocks are told (a model with sliding-window layers keeps other groups'
copies of the same tokens under other keys).

No torch: the engine core records; the publisher (quill/engine/kv_event_publisher.py) sends.
"""

from __future__ import annotations

from typing import Any

import msgspec


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """One change to the cache: a msgpack map tagged `"type": <class name>` (vLLM 0.26 on;
    earlier releases sent positional arrays)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes | int]  # consecutive blocks of one prompt, in order
    parent_block_hash: bytes | int | None  # the block before the first (None: it starts)
    token_ids: list[int]  # len(block_hashes) * block_size tokens
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes | int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KVEventLog:
    """The cache's changes since the last `drain`, merged as they come (a run of one prompt's
    blocks is one BlockStored; removals in a row are one BlockRemoved)."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._events: list[KVCacheEvent] = [AllBlocksCleared()]

    def stored(self, block_hash: bytes, parent: bytes | None, token_ids) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockStored) and parent is not None and last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self._events.append(
            BlockStored([block_hash], parent, list(token_ids), self.block_size, None, None, None)
        )

    def removed(self, block_hash: bytes) -> None:
        last = self._events[-1] if self._events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self._events.append(BlockRemoved([block_hash], None))

    def cleared(self) -> None:
        self._events = [AllBlocksCleared()]

    def drain(self) -> list[KVCacheEvent]:
        events, self._events = self._events, []
        return events


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)
