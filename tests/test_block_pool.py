"""The KV block pool and the scheduler under random traffic (torch-free, property-based)."""

from __future__ import annotations

import sys

from hypothesis import given, settings
from hypothesis import strategies as st

from quill.contract.sampling_params import SamplingParams
from quill.engine.block_pool import BlockPool
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler


def check_invariants(scheduler: Scheduler, content: dict[int, list] | None = None) -> None:
    kv = scheduler.kv
    pool = kv.pool
    owners: dict[int, int] = {}
    for table in kv.block_tables.values():
        assert len(table) == len(set(table)), "a block twice in one table"
        for b in table:
            owners[b] = owners.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == owners.get(b, 0), f"block {b}'s count is off"
        assert pool.is_free(b) == (b not in owners), f"block {b} both free and in a table"
    assert pool.num_free_blocks + len(owners) == pool.num_blocks, "a block leaked"
    for block_hash, b in pool.cached.items():
        assert pool.block_hashes[b] == block_hash
    assert sum(h is not None for h in pool.block_hashes) == len(pool.cached)
    for request in scheduler.running:
        table = kv.block_table(request.request_id)
        assert len(table) * kv.block_size >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert not kv.block_table(request.request_id)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    if content is not None:  # every cached block holds the tokens its hash was made from
        for b, block_hash in enumerate(pool.block_hashes):
            if block_hash is not None:
                assert tuple(content[b]) == BLOCK_TOKENS[block_hash], f"block {b} is stale"


# Hash -> the tokens of the block it names, for every full block any request ever hashed.
BLOCK_TOKENS: dict[bytes, tuple[int, ...]] = {}
PREFIXES = [[], list(range(100, 106)), list(range(100, 112)), list(range(200, 230))]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 120), st.integers(1, 40), st.integers(0, 3)),
        st.tuples(st.just("step"), st.just(0), st.just(0), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 50), st.just(0), st.just(0)),
        st.tuples(st.just("finish"), st.integers(0, 50), st.just(0), st.just(0)),
    ),
    max_size=80,
)


@settings(max_examples=150, deadline=None)
@given(
    ops=ops,
    num_blocks=st.integers(8, 40),
    budget=st.integers(4, 96),
    max_seqs=st.integers(1, 8),
    caching=st.booleans(),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_pool_under_random_traffic(ops, num_blocks, budget, max_seqs, caching, policy):
    """Random adds (prompts sharing one of a few prefixes, some ending mid-block), steps,
    aborts and stops; small pools force preemption and eviction of cached blocks."""
    kv = KVCacheManager(num_blocks, block_size=4, enable_prefix_caching=caching)
    scheduler = Scheduler(kv, budget, max_seqs, max_model_len=10_000, policy=policy)
    ids: list[str] = []
    requests: list[Request] = []
    content: dict[int, list] = {b: [None] * 4 for b in range(num_blocks)}
    for op, a, b, c in ops:
        if op == "add":
            rid = f"r{len(ids)}"
            prompt = (PREFIXES[c] + list(range(a)))[: max(a, 1)]
            priority = (a * 7 + b) % 3 if policy == "priority" else 0
            request = Request(
                rid, prompt, SamplingParams(max_tokens=b), float(len(ids)), b, priority=priority
            )
            if kv.can_ever_fit(len(prompt) + 1):
                scheduler.add_request(request)
                ids.append(rid)
                requests.append(request)
        elif op == "step":
            run_step(scheduler, content)
        elif ids:
            rid = ids[a % len(ids)]
            scheduler.finish_request(rid, "abort" if op == "abort" else "stop")
        remember_hashes(requests, kv.block_size)
        check_invariants(scheduler, content)
    for _ in range(10_000):  # drain: everything finishes, nothing is stuck
        if not scheduler.has_unfinished():
            break
        run_step(scheduler, content)
        remember_hashes(requests, kv.block_size)
        check_invariants(scheduler, content)
    assert not scheduler.has_unfinished()
    assert kv.pool.num_free_blocks == num_blocks
    assert not kv.block_tables
    if not caching:
        assert not kv.pool.cached and kv.stats.queries == 0


def remember_hashes(requests: list[Request], block_size: int) -> None:
    for r in requests:
        tokens = r.prompt_token_ids + r.output_token_ids
        for i, block_hash in enumerate(r.block_hashes):
            BLOCK_TOKENS[block_hash] = tuple(tokens[i * block_size : (i + 1) * block_size])


def run_step(scheduler: Scheduler, content: dict[int, list] | None = None) -> None:
    out = scheduler.schedule()
    assert out.num_batched_tokens <= scheduler.token_budget
    ids = [s.request.request_id for s in out.scheduled]
    assert len(ids) == len(set(ids))
    assert all(s.num_tokens >= 1 for s in out.scheduled), "a step must compute what it samples"
    kv = scheduler.kv
    for s in out.scheduled:  # the "model" writes each computed token's KV into its slot
        table = kv.block_table(s.request.request_id)
        tokens = s.request.token_ids_slice(s.start, s.start + s.num_tokens)
        for pos, token in enumerate(tokens, s.start):
            block = table[pos // kv.block_size]
            if content is not None:
                assert kv.pool.ref_counts[block] >= 1
                content[block][pos % kv.block_size] = token
    # A deterministic "model": the next token is the position; recompute must give it again.
    sampled = {s.request.request_id: [s.request.num_tokens] for s in out.scheduled if s.samples}
    scheduler.update(out, sampled)
    for s in out.scheduled:
        if s.samples:
            tokens = s.request.output_token_ids
            assert tokens == [len(s.request.prompt_token_ids) + i for i in range(len(tokens))]


def test_pool_refcounts():
    pool = BlockPool(4)
    a = pool.allocate(2)
    pool.take(a)
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
    scheduler.update(out, {"a": [8], "b": [8]})
    out = scheduler.schedule()  # both need a third block for position 8: "b" must yield
    assert out.preempted == ["b"]
    assert [s.request.request_id for s in out.scheduled] == ["a"]
    assert second.num_computed_tokens == 0 and second.output_token_ids == [8]
    assert scheduler.waiting.peek() is second


def test_scheduler_is_torch_free():
    import subprocess

    code = (
        "import sys; import quill.engine.scheduler, quill.engine.block_pool; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_cached_blocks_outlive_their_request_and_go_least_recently_used_first():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    a = Request("a", list(range(9)), SamplingParams(max_tokens=1), 0.0, 1)
    assert kv.allocate_slots(a, 9)
    kv.cache_blocks(a, 9)  # two full blocks; the third holds one token
    first, second, partial = kv.block_table("a")
    kv.free("a")
    assert kv.pool.num_free_blocks == 4 and len(kv.pool.cached) == 2
    # The partial block (nothing cached) is handed out before any cached one, then the
    # request's tail before its head.
    assert kv.pool.allocate(1) == [partial]
    fresh = kv.pool.allocate(2)
    assert partial not in kv.pool.cached.values()
    assert second in fresh and first not in fresh
    assert kv.pool.num_evictions == 1 and list(kv.pool.cached.values()) == [first]
    b = Request("b", list(range(9)), SamplingParams(max_tokens=1), 0.0, 1)
    assert kv.find_cached_prefix(b) == [first]


def test_a_failed_request_leaves_nothing_cached_that_only_it_held():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=1), 0.0, 1)
    b = Request("b", list(range(4)) + [9, 9, 9, 9, 9], SamplingParams(max_tokens=1), 0.0, 1)
    assert kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    shared = kv.find_cached_prefix(b)
    assert shared == kv.block_table("a")[:1]
    assert kv.allocate_slots(b, 9, shared)
    kv.free("a", uncache=True)  # its step failed: what only it wrote is forgotten
    assert list(kv.pool.cached.values()) == shared  # b holds the first block: it stays
