"""Discrete-event loops over replicas in virtual time: colocated, and prefill/decode split.

Each replica keeps its own clock, and the loop always handles the earliest thing next: an
arrival, a request handed from a prefill replica to a decode one, or the step of the busy
replica whose clock is furthest behind. Arrivals and hand-overs win ties, so a request that
arrives as a step would start is in that step. A step covers [clock, clock + price]; anything
that arrives meanwhile waits for the replica's next step, as it would on a real server.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from quill.contract.plan import RemoteKV
from quill.engine.request import Request, RequestTimes
from quill.sim.config import SimConfig
from quill.sim.metrics import SLO, Distribution, MetricsSink
from quill.sim.replica import SAMPLED_TOKEN, PromptTokens, Replica
from quill.sim.workload import WorkItem

ROUTERS = ("least-work", "round-robin", "least-load", "cache-aware")
Progress = Callable[[int], None]


class Router:
    """Picks a replica for each request.

    least-work: the replica holding the fewest tokens (prompt + reply) of unfinished requests,
    the lowest index on ties (an oracle: no real router knows this at once); round-robin:
    each in turn; least-load and cache-aware: `quill router`'s policies on the stale view a
    real router has (quill/sim/routing.py).
    """

    def __init__(
        self, kind: str, replicas: list[Replica], tokens: PromptTokens | None = None
    ) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}; routers: {', '.join(ROUTERS)}")
        self.kind = kind
        self.replicas = replicas
        self._next = 0
        self.routing = None
        if kind in ("least-load", "cache-aware"):
            from quill.sim.routing import SimRouter

            self.routing = SimRouter(kind, replicas, tokens or PromptTokens())

    def pick(self, item: WorkItem | None = None) -> Replica:
        if self.routing is not None:
            return self.routing.pick(item)
        if self.kind == "round-robin":
            replica = self.replicas[self._next]
            self._next = (self._next + 1) % len(self.replicas)
            return replica
        return min(self.replicas, key=lambda r: r.outstanding)

    def stepped(self, replica: Replica) -> None:
        if self.routing is not None:
            self.routing.stepped(replica)

    def arrivals_ended(self) -> None:
        if self.routing is not None:
            self.routing.arrivals_ended()


@contextmanager
def paused_gc() -> Iterator[None]:
    """The loops make millions of short-lived objects that form no cycles (plans, scheduled
    requests, token lists); the cycle collector would only walk the live ones again and again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _earliest(replicas: list[Replica]) -> tuple[Replica | None, float]:
    best, when = None, math.inf
    for replica in replicas:
        if replica.clock.t < when and replica.busy:
            best, when = replica, replica.clock.t
    return best, when


def _check(request: Request) -> None:
    if request.finish_reason == "error":  # the executor raised: a bug, not a result
        raise RuntimeError(f"a simulated step failed: {request.error}")


def run_colocated(
    config: SimConfig,
    workload: Iterable[WorkItem],
    num_replicas: int = 1,
    slo: SLO | None = None,
    router: str = "least-work",
    progress: Progress | None = None,
    record: bool = False,
) -> dict:
    """Every replica prefills and decodes its own requests (what `quill serve` does)."""
    sink = MetricsSink(slo, config.front_latency_s)
    tokens = PromptTokens()
    replicas = [
        Replica(config, sink, f"replica {i}", record=record, tokens=tokens)
        for i in range(num_replicas)
    ]
    route = Router(router, replicas, tokens)
    arrivals = iter(workload)
    item = next(arrivals, None)
    with paused_gc():
        while True:
            replica, when = _earliest(replicas)
            if item is not None and item.arrival_time <= when:
                target = route.pick(item)
                target.outstanding += item.prompt_tokens + item.output_tokens
                target.submit(item, item.arrival_time)
                item = next(arrivals, None)
                if item is None:
                    route.arrivals_ended()
                continue
            if replica is None:
                break
            # Replicas meet only through arrivals: each may run ahead to the next one.
            finished = replica.step(item.arrival_time if item is not None else math.inf)
            route.stepped(replica)
            for request in finished:
                _check(request)
                replica.outstanding -= request.num_prompt_tokens + request.max_tokens
                sink.record(request)
            if finished and progress is not None:
                progress(len(finished))
    out = _summary(sink, replicas)
    if route.routing is not None:
        out["routed"] = dict(route.routing.reasons)
    if record:
        out["_replicas"] = replicas  # the test reads their logs; never serialised
    return out


def run_disaggregated(
    config: SimConfig,
    workload: Iterable[WorkItem],
    num_prefill: int,
    num_decode: int,
    slo: SLO | None = None,
    router: str = "least-work",
    progress: Progress | None = None,
) -> dict:
    """Prefill replicas compute prompts and first tokens; decode replicas produce the rest.

    As `quill serve --disaggregate` runs them: when a prompt's prefill ends, the request goes at
    once to a decode replica (the router's pick) with its KV left on the prefill replica; the
    decode replica's scheduler takes it like any request (its prefix cache looked up first)
    and its executor fetches the KV beside the steps, one fetch after another (prompt tokens
    past those cached x the model's KV bytes per token, at the hardware's interconnect
    bandwidth per device); the request decodes from the first step after its KV is in. Not
    modelled: several decode replicas fetching from one prefill replica at once share nothing
    (each has a link of its own), and a fetch takes nothing from the steps beside it. The
    prefill replica frees its copy at once. A one-token reply is complete after prefill and
    never moves.
    """
    hardware = config.cost.hardware
    if hardware.interconnect_bandwidth is None:
        raise ValueError(f"--disaggregate needs the interconnect bandwidth of {hardware.name}")
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("--disaggregate needs at least one prefill and one decode replica")
    sink = MetricsSink(slo, config.front_latency_s)
    tokens = PromptTokens()
    prefill = [
        Replica(config, sink, f"prefill {i}", output_cap=1, tokens=tokens)
        for i in range(num_prefill)
    ]
    decode = [Replica(config, sink, f"decode {i}", tokens=tokens) for i in range(num_decode)]
    replicas = prefill + decode
    if router not in ("least-work", "round-robin"):
        raise ValueError(
            f"a prefill/decode split routes by least-work or round-robin, not {router}"
        )
    prefill_route, decode_route = Router(router, prefill), Router(router, decode)
    reply_len: dict[str, int] = {}  # request id -> output tokens, between arrival and decode
    handed_over: dict[str, float] = {}  # request id -> when its prefill ended, until fetched
    hand_overs: list[tuple[float, int, Replica, Request]] = []
    order = itertools.count()  # breaks ties between hand-overs at the same time
    transfer_s, transfer_wait_s = Distribution(), Distribution()

    def prefilled(replica: Replica, request: Request) -> bool:
        """Send a prefilled request on to a decode replica, or finish it (returns True)."""
        _check(request)
        replica.outstanding -= request.num_prompt_tokens
        out = reply_len.pop(request.request_id)
        if out == 1 or request.times.first_token is None:
            request.max_tokens = out  # its real reply length, for the truncation count
            sink.record(request)
            return True
        now = request.times.finished
        target = decode_route.pick()
        target.outstanding += request.num_prompt_tokens + out
        handed_over[request.request_id] = now
        # An event at `now`, not a submit at once: the decode replica's clock may be behind.
        moved = _moved(request, target, out, config.block_size)
        heapq.heappush(hand_overs, (now, next(order), target, moved))
        return False

    arrivals = iter(workload)
    item = next(arrivals, None)
    with paused_gc():
        while True:
            replica, when = _earliest(replicas)
            arrival = item.arrival_time if item is not None else math.inf
            if hand_overs and hand_overs[0][0] <= min(arrival, when):
                now, _, target, request = heapq.heappop(hand_overs)
                target.submit(request, now)
                continue
            if item is not None and arrival <= when:
                target = prefill_route.pick()
                target.outstanding += item.prompt_tokens
                reply_len[item.request_id] = item.output_tokens
                target.submit(item, arrival)
                item = next(arrivals, None)
                continue
            if replica is None:
                break
            # A decode replica meets the others through arrivals and hand-overs, and a
            # hand-over can come from any step a prefill replica has yet to run.
            until = min(arrival, hand_overs[0][0] if hand_overs else math.inf)
            for other in prefill:
                if other.busy and other.clock.t < until:
                    until = other.clock.t
            finished = replica.step(until)
            if replica.output_cap == 1:
                done_count = sum(prefilled(replica, request) for request in finished)
            else:
                fetches = replica.executor.fetches
                for request_id, start, seconds in fetches:
                    transfer_s.add(seconds)
                    transfer_wait_s.add(start - handed_over.pop(request_id))
                fetches.clear()
                done_count = len(finished)
                for request in finished:
                    _check(request)
                    replica.outstanding -= request.num_prompt_tokens + request.max_tokens
                    sink.record(request)
            if done_count and progress is not None:
                progress(done_count)
    out = _summary(sink, replicas, prefill)
    out["kv_transfer_ms"] = transfer_s.summary(1000.0)
    out["kv_transfer_wait_ms"] = transfer_wait_s.summary(1000.0)
    return out


def _moved(request: Request, target: Replica, out: int, block_size: int) -> Request:
    """The request as the decode replica receives it: prompt computed elsewhere, its KV to
    fetch (as the engine worker makes it from the prefill instance's reply), first token out."""
    times = request.times
    n = request.num_prompt_tokens
    remote = RemoteKV("prefill", 0, request.request_id, list(range(-(-n // block_size))), n,
                      SAMPLED_TOKEN)  # fmt: skip
    return Request(
        request.request_id,
        request.prompt_token_ids,
        target.params(out),
        request.arrival_time,
        out,
        output_token_ids=list(request.output_token_ids),
        num_computed_tokens=request.num_prompt_tokens,
        num_preemptions=request.num_preemptions,
        remote_kv=remote,
        kv_transferred=True,
        # Its blocks' hashes, as the prefill replica made them (one hasher for the whole run:
        # the decode replica would make the same ones again).
        block_hashes=list(request.block_hashes),
        times=RequestTimes(
            times.arrival,
            first_scheduled=times.first_scheduled,
            first_token=times.first_token,
            last_token=times.last_token,
            itl_counts=target.sink.itl.counts,
        ),
    )


def _summary(
    sink: MetricsSink, replicas: list[Replica], lookups: list[Replica] | None = None
) -> dict:
    """The run's results and each replica's stats. The prefix cache hit rate is over the
    lookups of the replicas that take arrivals (`lookups`, default all): a decode replica
    counts every request moved in with its KV as a lookup that missed."""
    duration = sink.duration
    stats = [r.stats(duration) for r in replicas]
    results = sink.results()
    mine = {id(r) for r in (replicas if lookups is None else lookups)}
    counted = [s for r, s in zip(replicas, stats) if id(r) in mine]
    queries = sum(s["prefix_cache_queries"] for s in counted)
    hits = sum(s["prefix_cache_hits"] for s in counted)
    results["prefix_cache_hit_rate"] = hits / queries if queries else None
    drafted = sum(s.get("spec_decode_num_draft_tokens", 0) for s in stats)
    if drafted:  # as a server's spec_decode_acceptance_rate
        accepted = sum(s["spec_decode_num_accepted_tokens"] for s in stats)
        results["spec_acceptance_rate"] = accepted / drafted
    return {"results": results, "replicas": stats}
