"""Scheduling policies: the order of the waiting queue, and of the running list. No torch.

- fcfs: waiting requests are admitted in arrival order (a preempted request goes back to the
  front); the running list is in admission order, so the KV pool's victim is the request
  admitted last.
- priority (as vLLM's `--scheduling-policy priority`): a lower `priority` value is served
  first. The running list is kept in (priority, arrival) order, so the scheduler serves it from
  the most important down and the victim (the last) is the least important, latest-arrived
  request; a request is never preempted for a less important one.

Starvation under priority is bounded by aging: a waiting request gains one level for every
`aging` seconds it has waited. Since every waiting request ages at the same rate, comparing
`priority - waited / aging` between two requests at any moment is comparing
`priority * aging + arrival_time`: a fixed key, so the queue stays a sorted list. A request of
priority p is admitted before any request of priority q < p that arrives more than
(p - q) * aging seconds after it; with `aging` infinite the order is strict and a low priority
can wait forever.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Iterator

from quill.config import SchedulingPolicy
from quill.engine.request import Request

DEFAULT_PRIORITY_AGING = 10.0  # seconds of waiting worth one priority level


class FcfsQueue:
    """Waiting requests in arrival order."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def push(self, request: Request) -> None:
        self._queue.append(request)

    def push_preempted(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)


class PriorityQueue:
    """Waiting requests by aged priority (see the module's docstring), then arrival."""

    def __init__(self, aging: float = DEFAULT_PRIORITY_AGING) -> None:
        if not aging > 0:
            raise ValueError(f"priority aging must be positive seconds (or inf), got {aging}")
        self.aging = aging
        # (key, request), sorted; the key ends in a unique counter, so requests never compare.
        self._entries: list[tuple[tuple, Request]] = []
        self._order = itertools.count()  # ties in the key keep their order of arrival here

    def push(self, request: Request) -> None:
        key = (*priority_key(request.priority, request.arrival_time, self.aging), next(self._order))
        bisect.insort(self._entries, (key, request))

    push_preempted = push  # its key puts it back where it was

    def peek(self) -> Request:
        return self._entries[0][1]

    def pop(self) -> Request:
        return self._entries.pop(0)[1]

    def remove(self, request: Request) -> None:
        del self._entries[next(i for i, (_, r) in enumerate(self._entries) if r is request)]

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Request]:
        return (request for _, request in self._entries)


def priority_key(priority: int, arrival_time: float, aging: float) -> tuple:
    """The waiting order under the priority policy: smaller first."""
    if math.isinf(aging):
        return (priority, arrival_time)
    return (priority * aging + arrival_time,)


def make_waiting_queue(policy: SchedulingPolicy, aging: float = DEFAULT_PRIORITY_AGING):
    if SchedulingPolicy(policy) is SchedulingPolicy.FCFS:
        return FcfsQueue()
    return PriorityQueue(aging)


def add_running(running: list[Request], request: Request, policy: SchedulingPolicy) -> None:
    """Put a newly admitted request in the running list where the policy wants it."""
    if policy == SchedulingPolicy.FCFS:
        running.append(request)
    else:
        key = (request.priority, request.arrival_time)
        i = bisect.bisect(running, key, key=lambda r: (r.priority, r.arrival_time))
        running.insert(i, request)
