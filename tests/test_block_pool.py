"""The KV block pool and the scheduler under random traffic (torch-free, property-based)."""

from __future__ import annotations

import sys

from hypothesis import example, given, settings
from hypothesis import strategies as st

from quill.contract.kv_groups import NULL_BLOCK, first_needed_block
from quill.contract.sampling_params import SamplingParams
from quill.engine.block_pool import BlockPool
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler


def check_invariants(scheduler: Scheduler, content: dict[int, list] | None = None) -> None:
    kv = scheduler.kv
    pool = kv.pool
    owners: dict[int, int] = {}
    for tables in kv.block_tables.values():
        assert len({len(t) for t in tables}) == 1, "a request's tables differ in length"
        blocks = [b for t in tables for b in t if b != NULL_BLOCK]
        assert len(blocks) == len(set(blocks)), "a block twice in a request's tables"
        for b in blocks:
            owners[b] = owners.get(b, 0) + 1
    for b in range(pool.num_blocks):
        assert pool.ref_counts[b] == owners.get(b, 0), f"block {b}'s count is off"
        assert pool.is_free(b) == (b not in owners), f"block {b} both free and in a table"
    assert pool.num_free_blocks + len(owners) == pool.num_blocks, "a block leaked"
    for block_hash, b in pool.cached.items():
        assert pool.block_hashes[b] == block_hash
    assert sum(h is not None for h in pool.block_hashes) == len(pool.cached)
    for request in scheduler.running:
        tables = kv.block_tables[request.request_id]
        assert len(tables[0]) * kv.block_size >= request.num_computed_tokens
        for window, table in zip(kv.group_windows, tables):
            # What the next token's window reads is held; behind it, at most a step's worth
            # waits to be freed.
            first = first_needed_block(window, request.num_computed_tokens, kv.block_size)
            assert NULL_BLOCK not in table[first:]
            if window:
                held = sum(b != NULL_BLOCK for b in table)
                assert held <= (scheduler.token_budget + window - 1) // kv.block_size + 2
    for request in scheduler.waiting:
        assert not kv.block_table(request.request_id)
    assert len(scheduler.running) <= scheduler.max_num_seqs
    if content is not None:  # every cached block holds the tokens its hash was made from
        for b, block_hash in enumerate(pool.block_hashes):
            if block_hash is not None:
                # A later group's key is (hash, group).
                tokens = BLOCK_TOKENS[block_hash[0] if type(block_hash) is tuple else block_hash]
                assert tuple(content[b]) == tokens, f"block {b} is stale"


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
    windows=st.sampled_from([(0,), (0, 6), (6, 6, 0), (9,), (5, 0, 13)]),
)
# Found by this test: preempted after 7 tokens, r1 recomputes 33 in one 33-token chunk, which its
# two tables (global, window 6) cannot hold in 16 blocks at once; it waited forever, alone.
@example(
    ops=[("add", 1, 9, 0), ("add", 26, 9, 0)], num_blocks=16, budget=33, max_seqs=2,
    caching=False, policy="fcfs", windows=(0, 6),
)  # fmt: skip
def test_pool_under_random_traffic(ops, num_blocks, budget, max_seqs, caching, policy, windows):
    """Random adds (prompts sharing one of a few prefixes, some ending mid-block), steps,
    aborts and stops; small pools force preemption and eviction of cached blocks. With KV
    groups of sliding windows (`windows`: each group's, 0 global) every key a step's queries
    read is still held and holds its token, while the blocks behind the windows are freed."""
    kv = KVCacheManager(num_blocks, 4, enable_prefix_caching=caching, group_windows=windows)
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
            if kv.can_ever_fit(len(prompt) + 1, min(budget, len(prompt) + 1)):
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
    size = kv.block_size
    for s in out.scheduled:  # the "model" writes each computed token's KV into its slot
        tables = kv.block_tables[s.request.request_id]
        tokens = s.request.token_ids_slice(s.start, s.start + s.num_tokens)
        for table in tables:
            for pos, token in enumerate(tokens, s.start):
                block = table[pos // size]
                if content is not None:
                    assert kv.pool.ref_counts[block] >= 1
                    content[block][pos % size] = token
    if content is not None:  # then attends: the step's first and last queries read their keys
        for s in out.scheduled:
            tables = kv.block_tables[s.request.request_id]
            everything = s.request.token_ids_slice(0, s.start + s.num_tokens)
            for query in {s.start, s.start + s.num_tokens - 1}:
                for window, table in zip(kv.group_windows, tables):
                    for key in range(max(0, query - window + 1) if window else 0, query + 1):
                        block = table[key // size]
                        assert block != NULL_BLOCK, f"key {key} of query {query} was freed"
                        assert content[block][key % size] == everything[key]
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


def test_a_recompute_alone_takes_smaller_chunks_where_its_windowed_tables_need_it():
    """A request decoded to 48 tokens (a global table and one of window 6: 12 + 3 blocks of
    16) is sent back to recompute: 12-token chunks fit until the last, which with the global
    table full would need 17. Alone, it takes the chunk the pool holds instead of ending."""
    kv = KVCacheManager(num_blocks=16, block_size=4, group_windows=(0, 6))
    scheduler = Scheduler(kv, max_num_batched_tokens=12, max_num_seqs=1, max_model_len=100)
    request = Request("a", list(range(8)), SamplingParams(max_tokens=42), 0.0, 42)
    scheduler.add_request(request)
    content = {b: [None] * 4 for b in range(16)}
    while request.num_tokens < 48:
        run_step(scheduler, content)
    scheduler.recompute("a")
    chunks = []
    while scheduler.has_unfinished():
        chunks.append(scheduler.schedule())
        out = chunks[-1]
        scheduler.update(out, {s.request.request_id: [s.request.num_tokens] for s in out.scheduled
                               if s.samples})  # fmt: skip
        check_invariants(scheduler)
    sizes = [out.scheduled[0].num_tokens for out in chunks if out.scheduled]
    # At 36: the global table's 9 blocks and the window's 2 (blocks 7-8) leave 5 free, 2 more
    # for each table: 44 tokens, a chunk of 8. At 44: 11 + 2 held, 3 free: 48, a chunk of 4.
    assert sizes == [12, 12, 12, 8, 4, 1]
    assert len(request.output_token_ids) == 42 and request.finish_reason == "length"
    assert request.output_token_ids == list(range(8, 50))


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
    assert kv.find_cached_prefix(b) == [[first]]


def test_a_failed_request_leaves_nothing_cached_that_only_it_held():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    a = Request("a", list(range(8)), SamplingParams(max_tokens=1), 0.0, 1)
    b = Request("b", list(range(4)) + [9, 9, 9, 9, 9], SamplingParams(max_tokens=1), 0.0, 1)
    assert kv.allocate_slots(a, 8)
    kv.cache_blocks(a, 8)
    shared = kv.find_cached_prefix(b)
    assert shared == [kv.block_table("a")[:1]]
    assert kv.allocate_slots(b, 9, shared)
    kv.free("a", uncache=True)  # its step failed: what only it wrote is forgotten
    assert list(kv.pool.cached.values()) == shared[0]  # b holds the first block: it stays
