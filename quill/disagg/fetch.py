"""The decode side of KV links: fetches a prompt's KV from the prefill instance that holds it.

The model runner calls `fetch_all` before a pass whose plan has rows with a `kv_source`; the
first fetch from a prefill instance pairs with it (one link per instance, kept). A failed fetch
(the prefill instance gone, timed out, the lease ended) drops that link and is reported for its
request alone, as a KVFetchError once the others are fetched.
"""

from __future__ import annotations

import time

from quill.contract.errors import KVFetchError
from quill.contract.plan import RemoteKV, SeqPlan
from quill.disagg.transfer import KVLayout, KVLink, LeaseGoneError, TransferError, connect


class KVFetcher:
    def __init__(self, runner, model_name: str, timeout_s: float) -> None:
        self.runner = runner
        self.layout = KVLayout.of(runner, model_name)
        self.timeout_s = timeout_s
        self.links: dict[tuple[str, int], KVLink] = {}
        self.num_fetched = 0
        self.num_failed = 0
        self.bytes_fetched = 0
        self.seconds = 0.0
        self.done: dict[str, tuple[int, float]] = {}  # request id -> (bytes, seconds), untaken

    def fetch_all(self, seqs: list[SeqPlan]) -> None:
        """Fetch every row's `kv_source` into its blocks (but those it holds already); raises
        KVFetchError naming the rows whose fetch failed, once the others are in."""
        failed = {}
        for s in seqs:
            if s.kv_source is None or s.request_id in self.done:  # none, or fetched already
                continue
            source = s.kv_source
            num_blocks = -(-source.num_tokens // self.runner.block_size)
            blocks = s.block_table[source.num_cached_blocks : num_blocks]
            try:
                self.fetch(s.request_id, source, blocks)
            except TransferError as e:
                failed[s.request_id] = str(e)
        if failed:
            raise KVFetchError(failed)

    def fetch(self, request_id: str, source: RemoteKV, block_ids: list[int]) -> None:
        """Receive `source`'s blocks (past the first `source.num_cached_blocks`) into these
        blocks of this instance's cache, for the request `request_id` here."""
        start = time.perf_counter()
        key = (source.host, source.port)
        try:
            link = self.links.get(key)
            if link is None:
                link = self.links[key] = connect(*key, self.layout, self.timeout_s)
            link.request_blocks(source.request_id, source.num_cached_blocks)
            link.recv_blocks(self.runner.kv_caches, block_ids)
        except LeaseGoneError:  # answered: the link is sound
            self.num_failed += 1
            raise
        except TransferError:
            self.links.pop(key, None)  # the link is in an unknown state: pair again next time
            self.num_failed += 1
            raise
        k = self.runner.kv_caches[0][0]
        moved = 2 * len(self.runner.kv_caches) * len(block_ids) * k[0].numel() * k.element_size()
        seconds = time.perf_counter() - start
        self.num_fetched += 1
        self.bytes_fetched += moved
        self.seconds += seconds
        self.done[request_id] = (moved, seconds)
