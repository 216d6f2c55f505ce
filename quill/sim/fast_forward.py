"""Many steady decode steps at once: what the engine core would do, without a plan per step.

Most of a long simulation is steps in which every running request decodes one token, nothing
waits and nothing ends. The core's own step spends its time building the plan, scheduling and
updating request by request; here a run of such steps is applied in one go, with exactly the
core's effects: each step priced by the cost model (one shape per step, its jitter drawn and its
gap added in the same order), a token and its time for every request, KV blocks allocated and
entered in the prefix cache at the step and in the order the scheduler would (the pool's free
list and eviction order stay the same), the executor's counters.

A run ends with the first step that ends a request (`max_tokens` or the context): the
requests it ends are finished as the core's update finishes them (in running order, their
blocks freed), and the core's next step admits what waits. A run also stops before the first
step starting at or after `until` (the next arrival or hand-over: arrivals win ties, as in the
event loop), and before a step whose blocks the pool cannot give (the core's own step then
preempts). It runs only where a step could do nothing else: no request that could be
admitted (none waiting, or the batch full at max_num_seqs; adds queued in since the last step
are moved to the waiting queue first, as the core's step would), none fetching; no
speculative decoding, structured output, KV leases, step listener or windowed attention;
every request plain (EOS ignored, no stop ids). A replica followed by a cache-aware router
(KV-cache events on) gets each step's events stamped with that step's end
(`Replica.fast_events`), as the core's steps would have handed them over one by one. The
core's step takes every other case, so the result is the same with it on or off
(tests/test_sim_fast_forward.py).
"""

from __future__ import annotations

import math

from quill.cost.batch import BatchShape

MIN_STEPS = 2  # shorter runs go through the core (the checks cost about a step)
GROW, FILL = 0, 1  # a request's block work in a step, in this order (as the scheduler's)


def steady_requests(replica) -> list | None:
    """The running requests, if the next steps can be fast-forwarded; None otherwise."""
    core = replica.core
    sched = core.scheduler
    kv = sched.kv
    running = sched.running
    if replica.record or core.admission is not None:
        return None
    # Adds queued since the last step go to the waiting queue first, as the core's next step
    # would take them.
    if core.has_pending and not core.take_pending_adds():
        return None
    # Requests waiting matter only where one could be admitted: not while the batch is full.
    if (replica.backlog or sched.waiting) and len(running) < sched.max_num_seqs:
        return None
    if (
        sched.fetching
        or sched.abandoned_fetches
        or sched.speculative is not None
        or core.structured is not None
        or core.step_listeners
        or kv.leases
        or replica.executor.has_fetches
    ):
        return None
    model = replica.executor.cost.model
    if model.sliding_window or model.layer_windows:
        return None
    if not running or len(running) > sched.token_budget:
        return None
    return running


def fast_forward(replica, until: float, token: int) -> list | None:
    """Run steady decode steps on `replica` while they start before `until`, each sampling
    `token` for every request; the requests the last of them ended (None: no step ran)."""
    if replica.clock.t >= until:
        return None
    running = steady_requests(replica)
    if running is None:
        return None
    sched = replica.core.scheduler
    max_len = sched.max_model_len
    steps = math.inf
    context = 0  # the sum of the requests' positions in the first step
    lefts = []  # each request's steps to its end
    for r in running:
        params = r.sampling_params
        if params.stop_token_ids or not (params.ignore_eos or not r.eos_token_ids):
            return None
        total = len(r.prompt_token_ids) + len(r.output_token_ids)
        if r.num_computed_tokens != total - 1:  # not decoding
            return None
        left = min(r.max_tokens - len(r.output_token_ids), max_len - total)
        if left < steps:
            steps = left
        lefts.append(left)
        context += total - 1
    ending = [r for r, left in zip(running, lefts) if left == steps]
    if any(r.kv_lease_s is not None for r in ending):  # its end leases blocks: the core's
        steps -= 1
        ending = []
    if steps < MIN_STEPS:
        return None
    done = _run(replica, running, int(steps), context, until, token)
    if not done:
        return None
    if done < steps:
        return []
    core = replica.core  # the clock is at the last step's end, as the core's update has it
    return [core.finish_request(r.request_id, "length") for r in ending]


def _run(replica, running: list, max_steps: int, context: int, until: float, token: int) -> int:
    kv = replica.core.scheduler.kv
    bs = kv.block_size
    caching = kv.enable_prefix_caching
    tables = kv.block_tables
    # Per step, the requests (in running order, as built) that reach the end of their blocks:
    # GROW: it needs a block before the step; FILL: it fills one (entered in the prefix cache).
    events: dict[int, list[tuple[int, int]]] = {}  # step -> [(request index, GROW or FILL)]
    for i, r in enumerate(running):
        c0 = r.num_computed_tokens
        capacity = len(tables[r.request_id][0]) * bs
        for j in range(capacity - c0, max_steps, bs):  # position c0 + j needs a new block
            events.setdefault(j, []).append((i, GROW))
        if caching:
            for j in range((bs - 1 - c0) % bs, max_steps, bs):  # c0 + j + 1 fills a block
                events.setdefault(j, []).append((i, FILL))
    ex = replica.executor
    price = ex.cost.price
    jitter = ex.jitter
    b = len(running)
    gap = ex.gap_base + ex.gap_per_seq * b
    for r in running:  # the tokens the steps will sample, there for the prefix cache's hashes
        r.output_token_ids.extend([token] * max_steps)
    clock = replica.clock
    t = clock.t
    ends: list[float] = []
    done = 0
    log = kv.pool.events  # KV-cache events (a cache-aware router follows them), or None
    while done < max_steps and t < until:
        bucket = events.get(done)
        if bucket is not None and not _blocks(kv, running, bucket, done):
            break
        pairs = context + b * (done + 1)
        seconds = price(BatchShape(b, b, b, 0, b, pairs, pairs, b)).predicted_s
        if jitter is not None:
            seconds *= jitter.draw("decode", t)
        seconds += gap
        ex.busy_s += seconds
        t += seconds
        ends.append(t)
        done += 1
        if log is not None and bucket is not None:
            drained = log.drain()
            if drained:
                replica.fast_events.append((t, drained))
    unused = max_steps - done
    for r in running:
        if unused:
            del r.output_token_ids[-unused:]
    if not done:
        return 0
    clock.t = t
    ex.num_steps += done
    ex.num_fast_steps += done
    ex.decode_tokens += b * done
    _tokens_at(running, ends)
    return done


def _blocks(kv, running: list, bucket: list[tuple[int, int]], step: int) -> bool:
    """The step's block work, with the scheduler's effects; False, with nothing done, if the
    pool cannot give every block it needs (the core's step then does the same work and
    preempts; its KV-cache events then come with that step).

    Each GROW needs one block per table (the events are exact: nothing else touches the
    tables during a run). The scheduler takes them request by request, registering each
    FILL's block between; here all of the step's blocks come in one allocation, in the same
    order, and the FILLs follow in theirs. The pool ends the same unless a FILL's content is
    already cached, in a free block a GROW could evict (then the order decides whether the
    FILL's copy is registered): such a step goes request by request."""
    tables = kv.block_tables
    pool = kv.pool
    grow = [running[i] for i, kind in bucket if kind == GROW]
    fill = [running[i] for i, kind in bucket if kind == FILL]
    if grow:
        groups = len(tables[grow[0].request_id])
        if len(grow) * groups > pool.num_free_blocks:
            return False
        if fill and (groups > 1 or not _fills_are_new(kv, fill, step)):
            return _blocks_in_order(kv, running, bucket, step)
        blocks = iter(pool.allocate(len(grow) * groups))
        for r in grow:
            for table in tables[r.request_id]:
                table.append(next(blocks))
    for r in fill:
        kv.cache_blocks(r, r.num_computed_tokens + step + 1)
    return True


def _fills_are_new(kv, fill: list, step: int) -> bool:
    """No FILL's block content is in the prefix cache yet (its hashes, made here, are the
    ones its registration uses)."""
    size, lookup = kv.block_size, kv.pool.lookup
    for r in fill:
        full = (r.num_computed_tokens + step + 1) // size
        if lookup(kv.block_hashes(r, full)[full - 1]) is not None:
            return False
    return True


def _blocks_in_order(kv, running: list, bucket: list[tuple[int, int]], step: int) -> bool:
    """The scheduler's order: each request's new block, then its FILL, one after another."""
    for i, kind in bucket:
        r = running[i]
        position = r.num_computed_tokens + step
        if kind == GROW:
            if not kv.allocate_slots(r, position + 1):
                raise RuntimeError("fast-forward: a block counted free could not be had")
        else:
            kv.cache_blocks(r, position + 1)
    return True


def _tokens_at(running: list, ends: list[float]) -> None:
    """Each request's tokens at the steps' ends: the first gap is its own (since its last
    token), the others are the steps' own, the same for every request."""
    k = len(ends)
    gaps = [b - a for a, b in zip(ends, ends[1:])]
    span = sum(gaps)
    widest = max(gaps) if gaps else 0.0
    shared_counts: dict[int, tuple[dict, int]] = {}
    for r in running:
        r.num_computed_tokens += k
        times = r.times
        times.on_token(ends[0])
        if k > 1:
            times.num_itl += k - 1
            times.itl_sum += span
            if widest > times.itl_max:
                times.itl_max = widest
            times.last_token = ends[-1]
            counts = times.itl_counts
            if counts is not None:
                entry = shared_counts.get(id(counts))
                shared_counts[id(counts)] = (counts, 1 if entry is None else entry[1] + 1)
    for counts, n in shared_counts.values():
        for g in gaps:
            counts[g] = counts.get(g, 0) + n
