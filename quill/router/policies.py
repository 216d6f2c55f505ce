"""How the router picks a replica for a whole request: round-robin, least-load, cache-aware.

Load is vLLM's data-parallel rule: waiting x 4 + running, from the replica's last report, plus
every request sent since that report (counted as waiting: the report cannot show it yet), so
a burst does not all land on the replica that looked idle a moment ago.

Cache-aware (the default) sends a request where the longest part of its prompt is cached, as
SGLang's router does, guarded by the load: while the replicas' loads are balanced, the replica
holding the longest prefix of the request's blocks wins if that prefix is at least
`cache_threshold` of the prompt's blocks (ties: the least loaded); with less, the least loaded
wins. When the loads are out of balance (the most loaded exceeds the least by more than
`balance_abs` *and* by more than `balance_rel` times), the least loaded wins whatever it holds:
a hot prefix must not pile every request onto one replica. The same rule runs in the simulator
(quill/sim/cluster.py), on the same state.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Protocol

POLICIES = ("cache-aware", "least-load", "round-robin")


class Candidate(Protocol):
    """What a policy reads of a replica (quill/router/instances.Instance, or the simulator's)."""

    @property
    def load(self) -> float: ...

    def matched(self, hashes: list[bytes], now: float) -> int: ...

    @property
    def blocks(self): ...  # quill/router/kv_index.ReplicaBlocks


@dataclass(frozen=True)
class CacheAwareSettings:
    cache_threshold: float = 0.3  # share of the prompt's blocks that must be cached
    balance_abs: float = 16.0  # load units (a waiting request is 4, a running one 1)
    balance_rel: float = 1.5


def vllm_load(running: float, waiting: float, sent_since: float) -> float:
    """vLLM's rule: waiting x 4 + running; a request sent since the last report waits."""
    return 4 * (waiting + sent_since) + running


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self._turn = itertools.count()

    def choose(self, candidates: list, hashes: list[bytes], now: float):
        return candidates[next(self._turn) % len(candidates)]


class LeastLoad:
    name = "least-load"

    def choose(self, candidates: list, hashes: list[bytes], now: float):
        return least_loaded(candidates)


class CacheAware:
    name = "cache-aware"

    def __init__(self, settings: CacheAwareSettings | None = None) -> None:
        self.settings = settings or CacheAwareSettings()
        self.last_reason = ""  # why the last choice was made (logs, tests)

    def choose(self, candidates: list, hashes: list[bytes], now: float, num_blocks=None):
        """`num_blocks`: the prompt's full blocks, when `hashes` are only those that could be
        cached somewhere (the simulator's: a prompt's own blocks match nowhere)."""
        s = self.settings
        loads = [c.load for c in candidates]
        low, high = min(loads), max(loads)
        if high - low > s.balance_abs and high > s.balance_rel * low:
            self.last_reason = "imbalanced"
            return least_loaded(candidates)
        if not hashes:
            self.last_reason = "no blocks"
            return least_loaded(candidates)
        matched = [c.matched(hashes, now) for c in candidates]
        best = max(range(len(candidates)), key=lambda i: (matched[i], -loads[i]))
        total = len(hashes) if num_blocks is None else num_blocks
        if matched[best] >= s.cache_threshold * total and matched[best] > 0:
            self.last_reason = "cached"
            return candidates[best]
        self.last_reason = "uncached"
        return least_loaded(candidates)


def least_loaded(candidates: list):
    """The least loaded; of equals, the one holding the fewest blocks (SGLang's tie-break:
    a new prefix goes where it evicts least, rather than every idle-time request to the
    first replica)."""
    return min(candidates, key=lambda c: (c.load, c.blocks.size))


def make_policy(name: str, settings: CacheAwareSettings | None = None):
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad()
    if name == "cache-aware":
        return CacheAware(settings)
    raise ValueError(f"unknown routing policy {name!r} (one of {', '.join(POLICIES)})")
