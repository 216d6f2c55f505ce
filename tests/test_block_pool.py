"""The KV block pool and the scheduler under random traffic (torch-free, property-based)."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from quill.engine.block_pool import BlockPool, KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler
from quill.sampling_params import SamplingParams


def check_invariants(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    pool = kv.pool
    owned = [b for table in kv.block_tables.values() for b in table]
    assert len(owned) == len(set(owned)), "a block is owned twice"
    assert pool.num_free_blocks + len(owned) == pool.num_blocks, "a block leaked"
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == (1 if b in set(owned) else 0)
    for request in scheduler.running:
        table = kv.block_table(request.request_id)
        assert len(table) * kv.block_size >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert not kv.block_table(request.request_id)
    assert len(scheduler.running) <= scheduler.max_num_seqs


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 40)),
        st.tuples(st.just("step"), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops, num_blocks=st.integers(8, 40), budget=st.integers(4, 96), max_seqs=st.integers(1, 8)
)
def test_pool_under_random_traffic(ops, num_blocks, budget, max_seqs):
    kv = KVCacheManager(num_blocks, block_size=4)
    scheduler = Scheduler(kv, budget, max_seqs, max_model_len=10_000)
    ids: list[str] = []
    produced: dict[str, list[int]] = {}
    for op, a, b in ops:
        if op == "add":
            rid = f"r{len(ids)}"
            request = Request(rid, list(range(a)), SamplingParams(max_tokens=b), 0.0, b)
            if kv.can_ever_fit(a + 1):
                scheduler.add_request(request)
                ids.append(rid)
        elif op == "step":
            run_step(scheduler, produced)
        elif ids:
            rid = ids[a % len(ids)]
            scheduler.finish_request(rid, "abort" if op == "abort" else "stop")
        check_invariants(scheduler)
    for _ in range(10_000):  # drain: everything finishes, nothing is stuck
        if not scheduler.has_unfinished():
            break
        run_step(scheduler, produced)
        check_invariants(scheduler)
    assert not scheduler.has_unfinished()
    assert kv.pool.num_free_blocks == num_blocks
    assert not kv.block_tables


def run_step(scheduler: Scheduler, produced: dict[str, list[int]]) -> None:
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.token_budget
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    # A deterministic "model": the next token is the position; recompute must give it again.
    sampled = {s.request.request_id: s.request.num_tokens for s in out.scheduled if s.samples}
    scheduler.update(out, sampled)
    for s in out.scheduled:
        if s.samples:
            tokens = s.request.output_token_ids
            assert tokens == [len(s.request.prompt_token_ids) + i for i in range(len(tokens))]


def test_pool_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.incref(a)
    pool.free(a)
    assert pool.num_free_blocks == 2
    pool.free(a)
    assert pool.num_free_blocks == 4
    try:
        pool.free(a)
    except ValueError as e:
        assert "freed twice" in str(e)
    else:
        raise AssertionError("double free went unnoticed")


def test_scheduler_preempts_latest_and_resumes():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    scheduler = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=100)
    first = Request("a", list(range(8)), SamplingParams(max_tokens=8), 0.0, 8)
    second = Request("b", list(range(8)), SamplingParams(max_tokens=8), 0.0, 8)
    scheduler.add_request(first)
    scheduler.add_request(second)
    out = scheduler.schedule()
    assert [s.num_tokens for s in out.scheduled] == [8, 8]  # 2 blocks each: the pool is full
    scheduler.update(out, {"a": 8, "b": 8})
    out = scheduler.schedule()  # both need a third block for position 8: "b" must yield
    assert out.preempted == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert second.num_computed_tokens == 0 and second.output_token_ids == [8]
    assert scheduler.waiting[0] is second


def test_scheduler_is_torch_free():
    import subprocess

    code = (
        "import sys; import quill.engine.scheduler, quill.engine.block_pool; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
