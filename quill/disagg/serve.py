"""The prefill side of a KV link: hands leased prompt KV to the decode instance that asks.

A thread beside the engine's step loop: it opens the link (waiting for the decode instance to
pair), then answers each request for a lease by sending its blocks, and tells the engine core
to free the lease once sent. It reads the cache while the engine steps: leased blocks are
written by no step (their request has ended), so the read is stable; the engine thread alone
adds and removes leases, and a lease gone by the time it is asked for (expired, aborted) is
answered as missing, never with other blocks.
"""

from __future__ import annotations

import json
import logging
import threading

from quill.disagg.transfer import PREFILL, KVLayout, KVLink, TransferError

log = logging.getLogger(__name__)

_FOREVER_S = 365 * 24 * 3600.0  # a decode instance may pair, and ask, whenever it likes


class KVServer:
    def __init__(
        self, core, runner, host: str, port: int, model_name: str, timeout_s: float
    ) -> None:
        self.core = core
        self.runner = runner
        self.address = (host, port)
        self.layout = KVLayout.of(runner, model_name)
        self.timeout_s = timeout_s
        self.num_sent = 0
        self.bytes_sent = 0
        # Called once a lease is to be freed: the engine process's loop sleeps when idle and
        # must step for the core to free it.
        self.on_release = lambda: None
        self._thread = threading.Thread(target=self._serve, name="quill-kv-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        host, port = self.address
        try:  # one decode instance pairs, and is served until it goes
            link = KVLink(PREFILL, host, port, self.layout, self.timeout_s, _FOREVER_S)
        except TransferError as e:
            log.error("KV link at %s:%d: %s", host, port, e)
            return
        log.info("KV link at %s:%d: a decode instance paired", host, port)
        try:
            while True:
                self._answer(link, json.loads(link.recv_request())["request_id"])
        except TransferError as e:
            log.warning("KV link at %s:%d: the decode instance left (%s)", host, port, e)
        link.close()

    def _answer(self, link: KVLink, request_id: str) -> None:
        lease = self.core.scheduler.kv.leases.get(request_id)
        if lease is None:
            link.send_missing()
            return
        caches = self.runner.kv_caches
        self.bytes_sent += link.send_blocks(caches, lease.block_ids, lease.num_tokens)
        self.num_sent += 1
        self.core.release_kv(request_id)
        self.on_release()
