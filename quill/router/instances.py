"""The instances behind the router, and their load: picked by the least work in hand.

Each instance's queue (running + waiting requests) is read from its /metrics every
`poll_s`; between polls the router adds what it sent since, so a burst does not all go to
the instance that looked idle a moment ago. An instance whose poll fails is skipped while
another of its kind answers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

log = logging.getLogger(__name__)

PREFILL, DECODE, WHOLE = "prefill", "decode", "whole"


@dataclass
class Instance:
    url: str
    kind: str  # PREFILL, DECODE or WHOLE
    num_queued: float = 0.0  # running + waiting at the last poll
    num_sent: int = 0  # requests sent since that poll
    num_in_flight: int = 0  # requests of this router it has not answered yet
    healthy: bool = True

    @property
    def load(self) -> float:
        return self.num_queued + self.num_sent


class Instances:
    def __init__(self, urls: dict[str, list[str]], poll_s: float = 0.25) -> None:
        self.all = [Instance(u.rstrip("/"), kind) for kind, us in urls.items() for u in us]
        self.poll_s = poll_s
        self._task: asyncio.Task | None = None

    def of(self, kind: str) -> list[Instance]:
        return [i for i in self.all if i.kind == kind]

    def pick(self, kind: str) -> Instance | None:
        """The instance of `kind` with the least load (healthy ones first); None if none."""
        candidates = self.of(kind)
        if not candidates:
            return None
        healthy = [i for i in candidates if i.healthy] or candidates
        chosen = min(healthy, key=lambda i: (i.load, i.num_in_flight))
        chosen.num_sent += 1
        return chosen

    # -- polling ---------------------------------------------------------------------------
    def start(self, client: httpx.AsyncClient) -> None:
        self._task = asyncio.ensure_future(self._poll_forever(client))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _poll_forever(self, client: httpx.AsyncClient) -> None:
        while True:
            await asyncio.gather(*(self.poll(client, i) for i in self.all))
            await asyncio.sleep(self.poll_s)

    async def poll(self, client: httpx.AsyncClient, instance: Instance) -> None:
        try:
            response = await client.get(f"{instance.url}/metrics", timeout=2.0)
            response.raise_for_status()
            queued = _queued(response.text)
        except (httpx.HTTPError, ValueError) as e:
            if instance.healthy:
                log.warning("instance %s does not answer: %s", instance.url, e)
            instance.healthy = False
            return
        if not instance.healthy:
            log.info("instance %s answers again", instance.url)
        instance.healthy = True
        instance.num_queued = queued
        instance.num_sent = 0


def _queued(text: str) -> float:
    """Running + waiting requests from an instance's /metrics."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name in ("quill:num_requests_running", "quill:num_requests_waiting"):
            total += sum(s.value for s in family.samples)
    return total
