"""Stored responses, in this process, bounded by size and by age.

A response is stored unless its request said `store: false`. What is kept: its object (for
`GET /v1/responses/{id}`), the conversation up to and including it as chat messages (for a
later request's `previous_response_id`), and, while a background response runs, its task.
Past `max_bytes` the oldest go first; past `ttl_s` a response is gone. A running background
response is never evicted for size. Conversations share their earlier messages by reference,
so an agent's long loop costs each turn only its own messages.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from quill.server.responses.builder import ResponseBuilder

log = logging.getLogger(__name__)


@dataclass
class StoredResponse:
    builder: ResponseBuilder
    history: list[dict]  # the conversation before the output: earlier turns and this input
    created: float = 0.0
    size: int = 0
    task: asyncio.Task | None = None  # a background response's run
    output_messages: list[dict] = field(default_factory=list)

    @property
    def running(self) -> bool:
        """Still generating (streamed, or in the background)."""
        return self.builder.status in ("queued", "in_progress")

    def conversation(self) -> list[dict]:
        """The whole conversation so far, for the turn that continues it."""
        return self.history + self.output_messages

    def finished(self) -> None:
        """Called once the reply ended: a complete (or cut) output joins the conversation."""
        if self.builder.status not in ("completed", "incomplete"):
            return
        self.output_messages = self.builder.conversation()
        self.size += _size(self.output_messages) + _size(self.builder.items)


def _size(value) -> int:
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")))


class ResponseStore:
    def __init__(
        self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, StoredResponse] = OrderedDict()

    @property
    def bytes_used(self) -> int:
        return sum(e.size for e in self.entries.values())

    def put(self, stored: StoredResponse, own_messages: list[dict]) -> None:
        """Keep `stored` (its own input messages `own_messages` are what it adds in size)."""
        stored.created = self.clock()
        stored.size = _size(own_messages) + 512
        self.entries[stored.builder.id] = stored
        self.trim()

    def trim(self) -> None:
        now = self.clock()
        for rid in [r for r, e in self.entries.items() if now - e.created > self.ttl_s]:
            if not self.entries[rid].running:
                del self.entries[rid]
        used = self.bytes_used
        for rid in list(self.entries):
            if used <= self.max_bytes:
                break
            if not self.entries[rid].running:
                used -= self.entries.pop(rid).size
                log.debug("response %s evicted from the store (size limit)", rid)

    def get(self, response_id: str) -> StoredResponse | None:
        self.trim()
        return self.entries.get(response_id)

    def delete(self, response_id: str) -> StoredResponse | None:
        return self.entries.pop(response_id, None)
