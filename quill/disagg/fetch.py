"""The decode side of KV links: fetches a prompt's KV from the prefill instance that holds it.

The model runner calls `fetch` before a pass whose plan carries a `kv_source`; the first fetch
from a prefill instance pairs with it (one link per instance, kept).
"""

from __future__ import annotations

import time

from quill.contract.plan import RemoteKV
from quill.disagg.transfer import DECODE, KVLayout, KVLink


class KVFetcher:
    def __init__(self, runner, model_name: str, timeout_s: float) -> None:
        self.runner = runner
        self.layout = KVLayout.of(runner, model_name)
        self.timeout_s = timeout_s
        self.links: dict[tuple[str, int], KVLink] = {}
        self.num_fetched = 0
        self.bytes_fetched = 0
        self.seconds = 0.0
        self.done: dict[str, tuple[int, float]] = {}  # request id -> (bytes, seconds), untaken

    def fetch(self, request_id: str, source: RemoteKV, block_ids: list[int]) -> None:
        """Receive `source`'s blocks into these blocks of this instance's cache, for the
        request `request_id` here."""
        start = time.perf_counter()
        key = (source.host, source.port)
        link = self.links.get(key)
        if link is None:
            link = self.links[key] = KVLink(
                DECODE, source.host, source.port, self.layout, self.timeout_s
            )
        try:
            link.request_blocks(source.request_id)
            link.recv_blocks(self.runner.kv_caches, block_ids)
        except Exception:
            del self.links[key]  # the link is in an unknown state: pair again next time
            raise
        k = self.runner.kv_caches[0][0]
        moved = 2 * len(self.runner.kv_caches) * len(block_ids) * k[0].numel() * k.element_size()
        seconds = time.perf_counter() - start
        self.num_fetched += 1
        self.bytes_fetched += moved
        self.seconds += seconds
        self.done[request_id] = (moved, seconds)
