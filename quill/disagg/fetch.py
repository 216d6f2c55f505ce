"""The decode side of KV links: fetches prompts' KV from the prefill instances that hold them.

The model runner hands each plan's `kv_fetches` to `start`; a thread of this fetcher does them
one after another, beside the model's passes (the requests fetched take no part in those: their
blocks are theirs alone until they are in), and the runner's `collect` puts the ones that ended
into the step's result. The first fetch from a prefill instance pairs with it (one link per
instance, kept). A failed fetch (the prefill instance gone, timed out, the lease ended) is
reported for its request alone and drops that link, unless the link answered.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

import torch

from quill.contract.plan import KVFetch, RemoteKV, StepResult
from quill.disagg.transfer import KVLayout, KVLink, LeaseGoneError, TransferError, connect

log = logging.getLogger(__name__)


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
        self._queue: queue.SimpleQueue[KVFetch | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._ended = threading.Condition(self._lock)
        self._in_flight = 0  # started, not yet collected
        self._fetched: dict[str, tuple[int, float]] = {}  # ended, not yet collected
        self._failed: dict[str, str] = {}
        # Started by the first fetch: a thread running from the start would hold the runner
        # (and the model and its KV cache) for as long as the process lives, though most
        # engines never fetch.
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        """Fetches started whose end the runner has not collected yet."""
        return self._in_flight > 0

    def start(self, fetches: list[KVFetch]) -> None:
        with self._lock:
            self._in_flight += len(fetches)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kv-fetch", daemon=True)
                self._thread.start()
        for fetch in fetches:
            self._queue.put(fetch)

    def collect(self, result: StepResult, wait_s: float = 0.0) -> None:
        """Move the fetches that ended into `result`; wait up to `wait_s` for one if none
        has."""
        with self._ended:
            if wait_s and self._in_flight and not (self._fetched or self._failed):
                self._ended.wait(wait_s)
            fetched, failed = self._fetched, self._failed
            self._fetched, self._failed = {}, {}
            self._in_flight -= len(fetched) + len(failed)
        result.kv_fetched.update(fetched)
        result.kv_fetch_failed.update(failed)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)

    def _run(self) -> None:
        while (fetch := self._queue.get()) is not None:
            source = fetch.source
            num_blocks = -(-source.num_tokens // self.runner.block_size)
            blocks = fetch.block_table[source.num_cached_blocks : num_blocks]
            try:
                with torch.inference_mode():  # the cache is an inference tensor
                    moved = self.fetch(source, blocks)
            except TransferError as e:
                with self._ended:
                    self._failed[fetch.request_id] = str(e)
                    self._ended.notify()
                continue
            except Exception as e:  # noqa: BLE001 - a bug here must not leave it waiting
                log.exception("KV fetch of %s failed", fetch.request_id)
                with self._ended:
                    self._failed[fetch.request_id] = f"{type(e).__name__}: {e}"
                    self._ended.notify()
                continue
            with self._ended:
                self._fetched[fetch.request_id] = moved
                self._ended.notify()

    def fetch(self, source: RemoteKV, block_ids: list[int]) -> tuple[int, float]:
        """Receive `source`'s blocks (past the first `source.num_cached_blocks`) into these
        blocks of this instance's cache; (bytes, seconds)."""
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
        return moved, seconds
