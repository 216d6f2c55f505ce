"""The simulated cache-aware router lets the replicas' KV-cache events go once every request
is routed: nothing after the last arrival can change a choice, and holding them to the end
made a routed run's memory grow with its length."""

from __future__ import annotations

from quill.cost.model import ModelSpec
from quill.sim.cluster import run_colocated
from quill.sim.routing import RoutedReplica, SimRouter
from tests.test_sim_fast_forward import _config, _same, _workload


def test_events_are_let_go_after_the_last_arrival_and_the_run_is_the_same(monkeypatch):
    per_block = 16 * ModelSpec.preset("SmolLM2-135M", 2).kv_bytes_per_token
    config = _config(max_num_seqs=32, kv_cache_memory=300 * per_block)
    work = _workload(rate=80.0, prefix=96)
    routers = []
    make = SimRouter.__init__

    def keep(self, *args, **kwargs):
        make(self, *args, **kwargs)
        routers.append(self)

    monkeypatch.setattr(SimRouter, "__init__", keep)
    dropped = run_colocated(config, work, 3, None, "cache-aware")
    for r in routers[-1].routed:
        assert not r._pending and r.replica.core.scheduler.kv.pool.events is None
    monkeypatch.setattr(RoutedReplica, "stop_following", lambda self: None)
    kept = run_colocated(config, work, 3, None, "cache-aware")
    assert sum(len(r._pending) for r in routers[-1].routed) > 0  # held to the end, unread
    _same(dropped, kept)
    assert dropped["results"]["prefix_cache_hit_rate"] > 0.3
