"""The prefill side of KV links: hands leased prompt KV to the decode instances that ask.

Threads beside the engine's step loop: one listens at the KV address and pairs with each decode
instance that connects; one per paired decode instance answers its requests for a lease by
sending the blocks, then tells the engine core to free the lease. They read the cache while the
engine steps: leased blocks are written by no step (their request has ended), and they are
copied under the lease lock, which the engine thread takes to free a lease, so no freed block
is read; a lease gone by the time it is asked for (expired, aborted) is answered as missing,
never with other blocks.
"""

from __future__ import annotations

import json
import logging
import threading

from quill.disagg.transfer import KVLayout, KVLink, KVListener, TransferError

log = logging.getLogger(__name__)


class KVServer:
    def __init__(
        self, core, runner, host: str, port: int, model_name: str, timeout_s: float
    ) -> None:
        self.core = core
        self.runner = runner
        self.address = (host, port)
        self.listener = KVListener(host, port, KVLayout.of(runner, model_name), timeout_s)
        self.num_sent = 0
        self.bytes_sent = 0
        self.num_peers = 0  # decode instances paired now
        self._lock = threading.Lock()
        # Called once a lease is to be freed: the engine process's loop sleeps when idle and
        # must step for the core to free it.
        self.on_release = lambda: None
        self._closed = False
        self._thread = threading.Thread(target=self._listen, name="quill-kv-listen", daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        host, port = self.address
        while not self._closed:
            try:
                # A long wait: each timed-out wait is a warning in torch's log.
                link = self.listener.accept(wait_s=3600.0)
            except TransferError as e:
                log.warning("KV link at %s:%d: a decode instance failed to pair: %s", host, port, e)
                continue
            if link is not None:
                name = f"quill-kv-peer-{self.listener.num_accepted}"
                threading.Thread(target=self._serve, args=(link,), name=name, daemon=True).start()

    def _serve(self, link: KVLink) -> None:
        with self._lock:
            self.num_peers += 1
        log.info("KV link at %s:%d: a decode instance paired", *self.address)
        try:
            while not self._closed:
                asked = json.loads(link.recv_request())
                self._answer(link, asked["request_id"], asked.get("skip", 0))
        except TransferError as e:
            log.warning("KV link at %s:%d: a decode instance left (%s)", *self.address, e)
        finally:
            with self._lock:
                self.num_peers -= 1
            link.close()

    def _answer(self, link: KVLink, request_id: str, skip: int) -> None:
        kv = self.core.scheduler.kv
        with kv.lease_lock:  # copied before the engine thread may free (and reuse) the blocks
            lease = kv.leases.get(request_id)
            if lease is not None:
                payload = link.gather_blocks(self.runner.kv_caches, lease.block_ids[skip:])
        if lease is None:
            link.send_missing()
            return
        sent = link.send_blocks(payload, lease.num_tokens)
        with self._lock:
            self.bytes_sent += sent
            self.num_sent += 1
        self.core.release_kv(request_id)
        self.on_release()

    def close(self) -> None:
        self._closed = True
