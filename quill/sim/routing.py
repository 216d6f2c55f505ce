"""The router of `quill simulate --replicas N`: the policies of `quill router`, on the view a
real router has.

A real router sees a replica's queues as of its last poll (every `poll_s`: 0.25 s, as `quill
router` polls /v1/loads) plus what it has sent since, and a replica's cached blocks as of its
KV-cache events, which reach it `events_delay_s` after the step that made them (a few hundred
ms through ZeroMQ and the router's loop). The simulated router reads the simulated replicas
the same way: the same policy objects (quill/router/policies.py), the same index of blocks
(quill/router/kv_index.ReplicaBlocks, expected blocks included), a snapshot of the queues at
each poll, and the replica's block-pool events held back by the delay.

The prompt's blocks: a simulated prompt shares only its prefix (quill/sim/replica.
PromptTokens), so its shared blocks' hashes are the replicas' hashes of the prefix's tokens,
made once per prefix; its own blocks match nowhere and are only counted.
"""

from __future__ import annotations

from collections import deque

from quill.engine.kv_events import KVEventLog
from quill.router.kv_index import ReplicaBlocks
from quill.router.policies import CacheAware, make_policy, vllm_load
from quill.router.prompt_blocks import prefix_hashes
from quill.sim.replica import PromptTokens, Replica, made_up_block_hash
from quill.sim.workload import WorkItem

POLL_S = 0.25
EVENTS_DELAY_S = 0.3


class RoutedReplica:
    """A replica as the router sees it."""

    def __init__(self, replica: Replica, follow_events: bool) -> None:
        self.replica = replica
        self.running = self.waiting = 0
        self.num_sent = 0
        self.blocks = ReplicaBlocks()
        self.blocks.has_events = follow_events
        self._pending: deque[tuple[float, list]] = deque()
        if follow_events:
            replica.core.scheduler.kv.pool.events = KVEventLog(replica.config.block_size)

    @property
    def load(self) -> float:
        return vllm_load(self.running, self.waiting, self.num_sent)

    def matched(self, hashes: list[bytes], now: float) -> int:
        return self.blocks.matched(hashes, now)

    def poll(self) -> None:
        scheduler = self.replica.core.scheduler
        self.running = scheduler.num_running
        self.waiting = scheduler.num_waiting + len(self.replica.backlog)
        self.num_sent = 0

    def stepped(self, delay_s: float) -> None:
        """After one of its steps (or a fast-forward's many): its events, seen `delay_s` after
        the step that made them."""
        fast = self.replica.fast_events
        if fast:
            self._pending.extend((t + delay_s, drained) for t, drained in fast)
            fast.clear()
        events = self.replica.core.scheduler.kv.pool.events
        if events is not None:
            drained = events.drain()
            if drained:
                self._pending.append((self.replica.clock.t + delay_s, drained))

    def stop_following(self) -> None:
        """No request is left to route: what the replica's cache does from now on can change
        no choice, so its events are neither recorded nor held (holding them until the end
        made a routed run's memory grow with its length)."""
        self._pending.clear()
        self.replica.fast_events.clear()
        self.replica.core.scheduler.kv.pool.events = None

    def catch_up(self, now: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= now:
            self.blocks.apply(pending.popleft()[1])


class SimRouter:
    """Picks a replica for each arriving request with one of `quill router`'s policies."""

    def __init__(
        self,
        policy: str,
        replicas: list[Replica],
        tokens: PromptTokens,
        poll_s: float = POLL_S,
        events_delay_s: float = EVENTS_DELAY_S,
        settings=None,
    ) -> None:
        self.policy = make_policy(policy, settings)
        self.cache_aware = isinstance(self.policy, CacheAware)
        self.routed = [RoutedReplica(r, self.cache_aware) for r in replicas]
        self.tokens = tokens
        self.poll_s = poll_s
        self.events_delay_s = events_delay_s
        self._next_poll = 0.0
        self._prefix_hashes: dict = {}
        self.block_size = replicas[0].config.block_size
        self.reasons: dict[str, int] = {}
        self._by_replica = {id(r.replica): r for r in self.routed}

    def stepped(self, replica: Replica) -> None:
        if self.cache_aware:
            self._by_replica[id(replica)].stepped(self.events_delay_s)

    def arrivals_ended(self) -> None:
        if self.cache_aware:
            for r in self.routed:
                r.stop_following()

    def pick(self, item: WorkItem) -> Replica:
        now = item.arrival_time
        if now >= self._next_poll:
            for r in self.routed:
                r.poll()
            self._next_poll = now + self.poll_s
        hashes, num_blocks = self._hashes(item)
        if self.cache_aware:
            for r in self.routed:
                r.catch_up(now)
            chosen = self.policy.choose(self.routed, hashes, now, num_blocks)
            if hashes:
                chosen.blocks.expect(hashes, now)
            reason = self.policy.last_reason
        else:
            chosen = self.policy.choose(self.routed, hashes, now)
            reason = self.policy.name
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        chosen.num_sent += 1
        return chosen.replica

    def _hashes(self, item: WorkItem) -> tuple[list[bytes], int]:
        num_blocks = item.prompt_tokens // self.block_size
        if not self.cache_aware or item.prefix_id is None:
            return [], num_blocks
        key = (item.prefix_id, item.prefix_tokens)
        hashes = self._prefix_hashes.get(key)
        if hashes is None:
            value = self.tokens.prefix_value(item.prefix_id)
            hashes = prefix_hashes(
                [value] * item.prefix_tokens, self.block_size, hasher=made_up_block_hash
            )
            self._prefix_hashes[key] = hashes
        return hashes, num_blocks
