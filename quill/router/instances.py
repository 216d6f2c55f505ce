"""The instances behind the router: their load, their cached blocks, whether they are up.

Each instance's load is read from its `GET /v1/loads` every `poll_s` (an instance without it,
another engine, from the vLLM-named gauges of its /metrics); between polls the router counts
what it sent since (quill/router/policies.py). An instance that publishes KV-cache events
(its /v1/loads says where) is followed for the cache-aware policy (quill/router/kv_index.py).

Up or down: a poll that fails takes the instance out of the rotation until one answers. A
refused connection means the process is gone: the instance is down at once, and the requests
in flight to it end with an error then (`down` is set) rather than waiting on a socket. An
instance whose polls time out for `dead_after_s` is down too (a machine gone without a word).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

from quill.router.kv_index import ReplicaBlocks, start_following
from quill.router.policies import vllm_load

log = logging.getLogger(__name__)

PREFILL, DECODE, WHOLE = "prefill", "decode", "whole"


@dataclass(eq=False)
class Instance:
    url: str
    kind: str  # PREFILL, DECODE or WHOLE
    running: float = 0.0  # at the last poll
    waiting: float = 0.0
    num_sent: int = 0  # requests sent since that poll
    num_in_flight: int = 0  # requests of this router it has not answered yet
    healthy: bool = True
    block_size: int = 16
    blocks: ReplicaBlocks = field(default_factory=ReplicaBlocks)
    down: asyncio.Event | None = None  # set while the instance is down (made in the loop)
    failing_since: float | None = None
    events_task: asyncio.Task | None = None

    @property
    def load(self) -> float:
        return vllm_load(self.running, self.waiting, self.num_sent)

    def matched(self, hashes: list[bytes], now: float) -> int:
        return self.blocks.matched(hashes, now)


class Instances:
    def __init__(
        self,
        urls: dict[str, list[str]],
        poll_s: float = 0.25,
        dead_after_s: float = 10.0,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the instances' (their /v1/loads asks for it)."""
        self.all = [Instance(u.rstrip("/"), kind) for kind, us in urls.items() for u in us]
        self.poll_s = poll_s
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._warned_key = False
        self.dead_after_s = dead_after_s
        self._task: asyncio.Task | None = None

    def of(self, kind: str) -> list[Instance]:
        return [i for i in self.all if i.kind == kind]

    def up(self, kind: str) -> list[Instance]:
        """The instances of `kind` in the rotation (all of them, if none answers: a request
        then gets the instance's own error rather than none)."""
        candidates = self.of(kind)
        return [i for i in candidates if i.healthy] or candidates

    def pick(self, kind: str) -> Instance | None:
        """The instance of `kind` with the least load; None if there is none."""
        candidates = self.up(kind)
        if not candidates:
            return None
        chosen = min(candidates, key=lambda i: (i.load, i.num_in_flight))
        chosen.num_sent += 1
        return chosen

    # -- polling ---------------------------------------------------------------------------
    def start(self, client: httpx.AsyncClient) -> None:
        self._task = asyncio.ensure_future(self._poll_forever(client))

    async def stop(self) -> None:
        tasks = [self._task] + [i.events_task for i in self.all]
        for task in tasks:
            if task is not None:
                task.cancel()

    async def _poll_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(self.poll(client, i) for i in self.all))
            await asyncio.sleep(self.poll_s)

    async def poll(self, client: httpx.AsyncClient, instance: Instance) -> None:
        if instance.down is None:
            instance.down = asyncio.Event()
        try:
            report = await self._report(client, instance)
        except (httpx.HTTPError, ValueError) as e:
            self._failed(instance, e)
            return
        if not instance.healthy:
            log.info("instance %s answers again", instance.url)
        instance.healthy = True
        instance.failing_since = None
        instance.down.clear()
        if report:
            instance.running = float(report.get("running", 0))
            # Requests its server holds that its engine has not reported yet wait too.
            unseen = report.get("requests_in_flight", 0) - instance.running
            instance.waiting = float(max(report.get("waiting", 0), unseen))
            instance.num_sent = 0
        instance.block_size = int(report.get("block_size") or instance.block_size)
        events = report.get("kv_events")
        if events and (instance.events_task is None or instance.events_task.done()):
            instance.events_task = start_following(instance.blocks, instance.url, events)

    async def _report(self, client: httpx.AsyncClient, instance: Instance) -> dict:
        """The instance's load report; {} when it answers but tells no load (its key)."""
        headers = self._headers
        response = await client.get(f"{instance.url}/v1/loads", headers=headers, timeout=2.0)
        if response.status_code in (401, 403, 404):  # not quill, or a key the router lacks
            if response.status_code != 404 and not self._warned_key:
                log.warning("instance %s wants an API key for /v1/loads (quill router "
                            "--api-key): its load is read from /metrics", instance.url)  # fmt: skip
                self._warned_key = True
            response = await client.get(f"{instance.url}/metrics", headers=headers, timeout=2.0)
            if response.status_code in (401, 403):
                return {}
            response.raise_for_status()
            return _from_metrics(response.text)
        response.raise_for_status()
        return response.json()

    def mark_down(self, instance: Instance, e: Exception) -> None:
        """A refused connection, seen by a request: out of the rotation at once."""
        if instance.down is None:
            instance.down = asyncio.Event()
        self._failed(instance, e)

    def _failed(self, instance: Instance, e: Exception) -> None:
        now = time.monotonic()
        if instance.healthy:
            log.warning("instance %s does not answer: %s", instance.url, e)
        instance.healthy = False
        if instance.failing_since is None:
            instance.failing_since = now
        gone = isinstance(e, httpx.ConnectError) or now - instance.failing_since > self.dead_after_s
        if gone and not instance.down.is_set():
            log.warning("instance %s is down: its requests in flight end now", instance.url)
            instance.down.set()


def _from_metrics(text: str) -> dict:
    """running and waiting from an instance's /metrics (vLLM's names; quill's if none)."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for prefix in ("vllm", "quill"):
            for key in ("running", "waiting"):
                if family.name == f"{prefix}:num_requests_{key}":
                    found[f"{prefix}:{key}"] = sum(s.value for s in family.samples)
    prefix = "vllm" if "vllm:running" in found or "vllm:waiting" in found else "quill"
    return {key: found.get(f"{prefix}:{key}", 0.0) for key in ("running", "waiting")}
