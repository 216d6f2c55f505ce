"""Priority scheduling on hand-built cases: admission order, the KV pool's victim, and the
starvation bound that aging gives (torch-free)."""

from __future__ import annotations

import math

import pytest

from quill.contract.errors import InvalidRequestError
from quill.contract.sampling_params import SamplingParams
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler


def request(rid: str, priority: int, arrival: float, prompt: int = 4, out: int = 1) -> Request:
    return Request(
        rid, list(range(prompt)), SamplingParams(max_tokens=out), arrival, out, priority=priority
    )


def admission_order(scheduler: Scheduler) -> list[str]:
    """Run to the end; the order in which requests were first scheduled."""
    order = []
    for _ in range(1000):
        if not scheduler.has_unfinished():
            return order
        out = scheduler.schedule()
        for s in out.scheduled:
            if s.request.request_id not in order:
                order.append(s.request.request_id)
        scheduler.update(out, {s.request.request_id: [1] for s in out.scheduled if s.samples})
    raise AssertionError("requests left unfinished")


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    scheduler = Scheduler(
        KVCacheManager(64, 4), 64, 1, 1000, policy="priority", priority_aging=math.inf
    )
    for rid, priority, arrival in [("a", 2, 0.0), ("b", 0, 1.0), ("c", 1, 2.0), ("d", 0, 3.0)]:
        scheduler.add_request(request(rid, priority, arrival))
    assert admission_order(scheduler) == ["b", "d", "c", "a"]


def test_fcfs_ignores_nothing_it_cannot_honour():
    scheduler = Scheduler(KVCacheManager(64, 4), 64, 4, 1000)
    with pytest.raises(InvalidRequestError) as e:
        scheduler.add_request(request("a", 1, 0.0))
    assert e.value.param == "priority"


def test_the_victim_is_the_least_important_not_the_latest_admitted():
    # 5 blocks of 4 tokens. "low" runs alone first; "high" joins; then "high" needs a block.
    kv = KVCacheManager(5, 4)
    scheduler = Scheduler(kv, 64, 4, 100, policy="priority", priority_aging=math.inf)
    low = request("low", 1, 0.0, prompt=8, out=8)
    scheduler.add_request(low)
    out = scheduler.schedule()
    scheduler.update(out, {"low": [8]})
    scheduler.add_request(request("high", 0, 1.0, prompt=8, out=8))
    out = scheduler.schedule()  # low's third block, then high's two: the pool is full
    assert [s.request.request_id for s in out.scheduled] == ["low", "high"]
    scheduler.update(out, {"low": [9], "high": [8]})
    assert [r.request_id for r in scheduler.running] == ["high", "low"]
    assert kv.pool.num_free_blocks == 0
    out = scheduler.schedule()
    # FCFS would preempt "high" (admitted last); priority preempts "low".
    assert out.preempted == ["low"]
    assert [s.request.request_id for s in out.scheduled] == ["high"]


def test_a_less_important_request_never_preempts_a_more_important_one():
    kv = KVCacheManager(4, 4)
    scheduler = Scheduler(kv, 64, 4, 100, policy="priority", priority_aging=math.inf)
    high = request("high", 0, 0.0, prompt=6, out=2)  # 2 blocks with room for 2 more tokens
    low = request("low", 5, 1.0, prompt=8, out=4)  # 2 full blocks: its next token needs a third
    scheduler.add_request(high)
    scheduler.add_request(low)
    out = scheduler.schedule()
    scheduler.update(out, {"high": [6], "low": [8]})
    out = scheduler.schedule()
    assert out.preempted == ["low"]  # it yields its own blocks rather than take "high"'s
    assert [s.request.request_id for s in out.scheduled] == ["high"]


@pytest.mark.parametrize("aging", [1.0, 0.25])
def test_aging_bounds_how_long_a_low_priority_request_waits(aging):
    """Priority 5 arriving at 0 goes before every priority-0 request that arrives after
    5 * aging seconds, and after those that arrive before."""
    scheduler = Scheduler(
        KVCacheManager(256, 4), 64, 1, 1000, policy="priority", priority_aging=aging
    )
    scheduler.add_request(request("low", 5, 0.0))
    arrivals = [0.05 + 0.1 * i for i in range(80)]  # none exactly at the bound
    for i, t in enumerate(arrivals):
        scheduler.add_request(request(f"h{i}", 0, t))
    order = admission_order(scheduler)
    position = order.index("low")
    bound = 5 * aging
    assert all(arrivals[int(r[1:])] < bound for r in order[:position])
    assert all(arrivals[int(r[1:])] > bound for r in order[position + 1 :])


def test_without_aging_a_low_priority_request_waits_for_all():
    scheduler = Scheduler(
        KVCacheManager(256, 4), 64, 1, 1000, policy="priority", priority_aging=math.inf
    )
    scheduler.add_request(request("low", 5, 0.0))
    for i in range(30):
        scheduler.add_request(request(f"h{i}", 0, 0.1 * (i + 1)))
    assert admission_order(scheduler)[-1] == "low"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-ttft-slo", "-5"], "--max-ttft-slo: milliseconds: must be positive"),
        (["--max-ttft-slo", "nan"], "--max-ttft-slo: milliseconds: must be positive"),
        (["--priority-aging", "0"], "--priority-aging: seconds: must be positive"),
        (["--scheduling-policy", "lifo"], "invalid choice: 'lifo'"),
    ],
)
def test_bad_scheduling_flags_are_refused_by_name(flags, message, capsys):
    import argparse

    from quill.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(flags)
    assert message in capsys.readouterr().err


def test_scheduling_flags_reach_the_engine_config():
    import argparse

    from quill.config import EngineConfig
    from quill.engine_args import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = parser.parse_args(
        ["--no-enable-prefix-caching", "--scheduling-policy", "priority", "--max-ttft-slo", "250"]
    )
    config = EngineConfig(**engine_options(args))
    assert not config.enable_prefix_caching and config.scheduling_policy == "priority"
    assert config.max_ttft_slo == 0.25 and config.priority_aging == 10.0
