"""Which prefix blocks each replica holds: from its KV-cache events, and from what the router
has just sent it.

A replica's events (quill/engine/kv_events.py) say exactly which blocks it caches, but they
come after the fact: the blocks of a request just sent exist only once the replica schedules
it. Until then the router counts them as *expected* on that replica for `expect_s` seconds,
so that the next requests of the same prefix follow the first instead of scattering while the
events are on their way (an event, stored or removed, then says what is true). A replica that
publishes no events is known by what was sent to it alone, for longer (`expect_s` of an
approximate index: 120 s, as Dynamo's approximate router keeps them).
"""

from __future__ import annotations

import asyncio
import logging
import time
from urllib.parse import urlsplit

from quill.engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch

log = logging.getLogger(__name__)

EXPECT_S = 10.0  # a sent request's blocks, expected until its events arrive
APPROXIMATE_EXPECT_S = 120.0  # a replica with no events: what was sent is all there is
_EXPECTED_KEPT = 100_000  # expected blocks held before the lapsed ones are swept


class ReplicaBlocks:
    """One replica's blocks: held (from events) and expected (sent, until this time)."""

    def __init__(self) -> None:
        self.held: set[bytes] = set()
        self.expected: dict[bytes, float] = {}
        self.has_events = False
        self.last_seq = -1
        self.num_batches = 0

    def matched(self, hashes: list[bytes], now: float) -> int:
        """How many of the request's leading blocks this replica holds or is expected to."""
        n = 0
        for h in hashes:
            if h in self.held:
                n += 1
                continue
            until = self.expected.get(h)
            if until is None or until < now:
                break
            n += 1
        return n

    @property
    def size(self) -> int:
        """Blocks held or expected (some of those maybe lapsed): how full it looks."""
        return len(self.held) + len(self.expected)

    def expect(self, hashes: list[bytes], now: float) -> None:
        until = now + (EXPECT_S if self.has_events else APPROXIMATE_EXPECT_S)
        for h in hashes:
            if h not in self.held:
                self.expected[h] = until
        if len(self.expected) > _EXPECTED_KEPT:  # drop the lapsed ones now and then
            self.expected = {h: t for h, t in self.expected.items() if t >= now}

    def apply(self, events) -> None:
        for event in events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    self.held.add(h)
                    self.expected.pop(h, None)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    self.held.discard(h)
                    self.expected.pop(h, None)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()
                self.expected.clear()


def events_address(replica_url: str, endpoint: str) -> str:
    """Where a router connects for an endpoint the replica bound (`tcp://*:5557`: the
    replica's own host)."""
    scheme, _, rest = endpoint.partition("://")
    host, _, port = rest.rpartition(":")
    if host in ("*", "0.0.0.0", "", "::", "[::]"):
        host = urlsplit(replica_url).hostname or "127.0.0.1"
    return f"{scheme}://{host}:{port}"


async def follow_events(blocks: ReplicaBlocks, url: str, kv_events: dict) -> None:
    """Keep `blocks` up to date from the replica's events (runs until cancelled). A gap in
    the sequence numbers is filled from the replay socket when the replica has one; a
    subscriber that joins late replays from the start of the replica's buffer."""
    import zmq
    import zmq.asyncio

    context = zmq.asyncio.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    topic = (kv_events.get("topic") or "").encode()
    sub.setsockopt(zmq.SUBSCRIBE, topic)
    sub.connect(events_address(url, kv_events["endpoint"]))
    replay_endpoint = kv_events.get("replay_endpoint")
    replay_address = events_address(url, replay_endpoint) if replay_endpoint else None
    blocks.has_events = True
    try:
        while True:
            _topic, seq_bytes, payload = await sub.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big")
            if seq < blocks.last_seq:  # the replica started again: its numbers did too
                blocks.last_seq = -1
            if seq > blocks.last_seq + 1 and replay_address is not None:
                await _replay(context, replay_address, blocks, seq)
            if seq > blocks.last_seq:
                blocks.apply(decode_batch(payload).events)
                blocks.last_seq = seq
                blocks.num_batches += 1
    finally:
        sub.close()


async def _replay(context, address: str, blocks: ReplicaBlocks, upto: int) -> None:
    """Apply the batches after `blocks.last_seq` and before `upto` from the replay socket."""
    import zmq

    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(address)
    try:
        await dealer.send_multipart((b"", (blocks.last_seq + 1).to_bytes(8, "big")))
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            if not await dealer.poll(timeout=int(1000 * (deadline - time.monotonic())) + 1):
                break
            _empty, _topic, seq_bytes, payload = await dealer.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq < 0:
                return
            if blocks.last_seq < seq < upto:
                blocks.apply(decode_batch(payload).events)
                blocks.last_seq = seq
        log.warning("KV events: replay from %s did not finish; the index may lag", address)
    finally:
        dealer.close()


def start_following(blocks: ReplicaBlocks, url: str, kv_events: dict) -> asyncio.Task:
    return asyncio.ensure_future(follow_events(blocks, url, kv_events))
