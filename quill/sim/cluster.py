"""Discrete-event loops over replicas in virtual time: colocated, and prefill/decode split.

Each replica keeps its own clock, and the loop always handles the earliest thing next: an
arrival, a finished KV transfer, or the step of the busy replica whose clock is furthest
behind. Arrivals and transfers win ties, so a request that arrives as a step would start is in
that step. A step covers [clock, clock + price]; anything that arrives meanwhile waits for the
replica's next step, as it would on a real server.
"""

from __future__ import annotations

import gc
import heapq
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

from quill.engine.request import Request, RequestTimes
from quill.sim.config import SimConfig
from quill.sim.metrics import SLO, Distribution, MetricsSink
from quill.sim.replica import PromptTokens, Replica
from quill.sim.workload import WorkItem

ROUTERS = ("least-work", "round-robin")
Progress = Callable[[int], None]


class Router:
    """Picks a replica for each request.

    least-work: the replica holding the fewest tokens (prompt + reply) of unfinished requests,
    the lowest index on ties; round-robin: each in turn.
    """

    def __init__(self, kind: str, replicas: list[Replica]) -> None:
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}; routers: {', '.join(ROUTERS)}")
        self.kind = kind
        self.replicas = replicas
        self._next = 0

    def pick(self) -> Replica:
        if self.kind == "round-robin":
            replica = self.replicas[self._next]
            self._next = (self._next + 1) % len(self.replicas)
            return replica
        return min(self.replicas, key=lambda r: r.outstanding)


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
    sink = MetricsSink(slo)
    tokens = PromptTokens()
    replicas = [
        Replica(config, sink, f"replica {i}", record=record, tokens=tokens)
        for i in range(num_replicas)
    ]
    route = Router(router, replicas)
    arrivals = iter(workload)
    item = next(arrivals, None)
    with paused_gc():
        while True:
            replica, when = _earliest(replicas)
            if item is not None and item.arrival_time <= when:
                target = route.pick()
                target.outstanding += item.prompt_tokens + item.output_tokens
                target.submit(item, item.arrival_time)
                item = next(arrivals, None)
                continue
            if replica is None:
                break
            finished = replica.step()
            for request in finished:
                _check(request)
                replica.outstanding -= request.num_prompt_tokens + request.max_tokens
                sink.record(request)
            if finished and progress is not None:
                progress(len(finished))
    out = _summary(sink, replicas)
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

    A prefilled request's KV cache (prompt tokens x the model's KV bytes per token) then goes
    to a decode replica, chosen by the router when its prefill ends, over the prefill replica's
    outgoing link: one transfer at a time per prefill replica, first come first served, at the
    hardware's interconnect bandwidth per device (with tp > 1 each device sends its share at
    once). The prefill replica frees its copy at once: only the time of the move is modelled.
    A one-token reply is complete after prefill and never moves.
    """
    hardware = config.cost.hardware
    if hardware.interconnect_bandwidth is None:
        raise ValueError(f"--disaggregate needs the interconnect bandwidth of {hardware.name}")
    if num_prefill < 1 or num_decode < 1:
        raise ValueError("--disaggregate needs at least one prefill and one decode replica")
    link_rate = hardware.interconnect_bandwidth * config.cost.tp
    kv_per_token = config.cost.model.kv_bytes_per_token
    sink = MetricsSink(slo)
    tokens = PromptTokens()
    prefill = [
        Replica(config, sink, f"prefill {i}", output_cap=1, tokens=tokens)
        for i in range(num_prefill)
    ]
    decode = [Replica(config, sink, f"decode {i}", tokens=tokens) for i in range(num_decode)]
    replicas = prefill + decode
    prefill_route, decode_route = Router(router, prefill), Router(router, decode)
    link_free = {id(r): 0.0 for r in prefill}
    reply_len: dict[str, int] = {}  # request id -> output tokens, between arrival and decode
    transfers: list[tuple[float, int, Replica, Request]] = []
    transfer_s, transfer_wait_s = Distribution(), Distribution()
    order = itertools.count()  # breaks ties between transfers that end at the same time

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
        start = max(link_free[id(replica)], now)
        seconds = kv_per_token * request.num_prompt_tokens / link_rate
        done = start + seconds
        link_free[id(replica)] = done
        transfer_s.add(seconds)
        transfer_wait_s.add(start - now)
        target = decode_route.pick()
        target.outstanding += request.num_prompt_tokens + out
        heapq.heappush(transfers, (done, next(order), target, _moved(request, target, out)))
        return False

    arrivals = iter(workload)
    item = next(arrivals, None)
    with paused_gc():
        while True:
            replica, when = _earliest(replicas)
            arrival = item.arrival_time if item is not None else math.inf
            if transfers and transfers[0][0] <= min(arrival, when):
                done, _, target, request = heapq.heappop(transfers)
                target.submit(request, done)
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
            finished = replica.step()
            if replica.output_cap == 1:
                done_count = sum(prefilled(replica, request) for request in finished)
            else:
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


def _moved(request: Request, target: Replica, out: int) -> Request:
    """The request as the decode replica receives it: prompt computed, first token out."""
    times = request.times
    return Request(
        request.request_id,
        request.prompt_token_ids,
        target.params(out),
        request.arrival_time,
        out,
        output_token_ids=list(request.output_token_ids),
        num_computed_tokens=request.num_prompt_tokens,
        num_preemptions=request.num_preemptions,
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
    return {"results": results, "replicas": stats}
