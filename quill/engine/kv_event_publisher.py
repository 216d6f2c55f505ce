"""Publishes the engine's KV-cache events over ZeroMQ, framed as vLLM frames them.

Each step's events are one `KVEventBatch` (quill/engine/kv_events.py), sent on the PUB socket
as three frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0), and the
msgpack payload. The last `buffer_steps` batches are kept; a subscriber that sees a gap in the
numbers asks the replay socket (ROUTER) for them: it sends the first number it lacks (8 bytes,
big-endian; a DEALER socket, as (empty, number): a REQ socket would take one reply only), and
gets back each kept batch from there as (topic, number, payload), then (empty, -1, empty).

The step loop only queues a batch: a thread owns the sockets, so a slow network or a replay
never delays a step. A full queue drops the batch (counted, and a warning): a router that
misses events sees the gap in the numbers and replays or rebuilds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

from quill.config import KVEventsConfig
from quill.engine.kv_events import KVCacheEvent, KVEventBatch, encode_batch

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.config = config
        self.rank = data_parallel_rank
        self.num_dropped = 0
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._context = zmq.Context()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)  # here, so that a port in use fails the start
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._topic = config.topic.encode()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        log.info(
            "KV-cache events: published at %s%s",
            config.endpoint,
            f", replayed at {config.replay_endpoint}" if config.replay_endpoint else "",
        )

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queue one step's events (never blocks)."""
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.rank))
        except queue.Full:
            self.num_dropped += 1
            if self.num_dropped == 1 or self.num_dropped % 1000 == 0:
                log.warning("KV-cache events: %d batches dropped (queue full)", self.num_dropped)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)
        self._context.destroy(linger=0)

    def _run(self) -> None:
        import zmq

        seq = 0
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while True:
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            payload = encode_batch(batch)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:
                log.warning("KV-cache events: a batch was not sent: %s", e)
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV-cache events: a replay request of %d frames ignored", len(frames))
            return
        client, empty, start = frames
        first = int.from_bytes(start, "big")
        topic = self._topic
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, empty, topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, empty, b"", END_OF_REPLAY, b""))
