"""A prefill instance's KV lease (disaggregation): a finished request's prompt blocks are kept
for a decode instance to fetch, then freed when it says so, when the lease ends, or when the
request is aborted; never leaked (the pool back to its idle count after each)."""

from __future__ import annotations

import pytest

from quill import SamplingParams
from quill.contract.plan import StepPlan, StepResult
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler

BLOCK = 4
NUM_BLOCKS = 32


class _Executor:
    """Every sampling row gets token 7; each step takes 0.25 s of virtual time."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock

    def execute(self, plan: StepPlan) -> StepResult:
        self.clock.advance(0.25)
        return StepResult({s.request_id: [7] for s in plan.seqs if s.samples})


def _core() -> tuple[EngineCore, VirtualClock]:
    clock = VirtualClock()
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_prefix_caching=True)
    return EngineCore(Scheduler(kv, 64, 8, 256), _Executor(clock), clock), clock


def _prefill_request(rid: str, prompt_len: int, lease_s: float = 30.0) -> Request:
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    request = Request(rid, list(range(100, 100 + prompt_len)), params, 0.0, 1)
    request.kv_lease_s = lease_s
    return request


def _run(core: EngineCore) -> dict[str, Request]:
    finished = {}
    while core.has_unfinished_requests():
        finished.update({r.request_id: r for r in core.step().finished})
    return finished


def _free(core: EngineCore) -> int:
    return core.scheduler.kv.pool.num_free_blocks


@pytest.mark.parametrize("prompt_len", [10, 12])  # 12: an exact multiple of the block size
def test_the_prompt_blocks_stay_until_released(prompt_len):
    core, _ = _core()
    done = _run_one(core, _prefill_request("p", prompt_len))
    lease = done.kv_lease
    assert done.finish_reason == "length" and done.output_token_ids == [7]
    # Exactly the blocks of the prompt's keys and values (the first token has none yet).
    assert lease.num_tokens == prompt_len and len(lease.block_ids) == -(-prompt_len // BLOCK)
    assert _free(core) == NUM_BLOCKS - len(lease.block_ids)
    core.release_kv("p")
    core.step()
    assert _free(core) == NUM_BLOCKS and core.scheduler.kv.leases == {}


def _run_one(core: EngineCore, request: Request) -> Request:
    core.add_request(request)
    return _run(core)[request.request_id]


def test_a_lease_nobody_fetches_ends_on_time():
    core, clock = _core()
    _run_one(core, _prefill_request("p", 10, lease_s=5.0))
    assert core.next_lease_expiry() == pytest.approx(0.25 + 5.0)
    clock.advance(4.0)
    core.step()
    assert "p" in core.scheduler.kv.leases  # not yet
    clock.advance(1.5)
    core.step()
    assert core.scheduler.kv.leases == {} and _free(core) == NUM_BLOCKS
    assert core.next_lease_expiry() is None


def test_an_abort_frees_a_lease_and_other_requests_are_untouched():
    core, _ = _core()
    _run_one(core, _prefill_request("p", 10))
    plain = Request("q", [1, 2, 3, 4, 5], SamplingParams(max_tokens=3, ignore_eos=True), 0.0, 3)
    core.add_request(plain)
    core.step()
    core.abort_request("p")  # the decode side gave up, or the client went away
    _run(core)
    assert core.scheduler.kv.leases == {} and _free(core) == NUM_BLOCKS


def test_failed_or_aborted_requests_lease_nothing():
    core, _ = _core()
    request = _prefill_request("p", 10)
    core.add_request(request)
    core.abort_request("p")
    _run(core)
    assert request.kv_lease is None and _free(core) == NUM_BLOCKS
    request = Request("e", list(range(10)), SamplingParams(max_tokens=3, ignore_eos=True), 0.0, 3)
    request.kv_lease_s = 30.0
    core.add_request(request)
    core.step()  # running now, its first token out
    core.finish_request("e", "error", error="boom")
    assert request.kv_lease is None and _free(core) == NUM_BLOCKS


def test_leased_blocks_keep_their_prefix_cache_entries():
    """Released, the blocks go back to the pool still cached, as any finished request's do."""
    core, _ = _core()
    _run_one(core, _prefill_request("p", 12))
    core.release_kv("p")
    again = Request("r", list(range(100, 113)), SamplingParams(max_tokens=1), 0.0, 1)
    _run_one(core, again)
    assert again.num_cached_tokens == 12
