"""The speculation switch (quill/engine/spec_switch.py) against hand-worked prices, and the
scheduler's side of drafts (quill/engine/scheduler.py): KV booked for them and given back,
only verified blocks cached, drafts kept within a request's limits. No model, no torch.

The hand-made machine: a step costs max(10 ms, 0.1 ms x tokens), a weight read of 10 ms until
100 tokens make it arithmetic-bound. With the prior acceptance 0.6 per position
(E(d) = 0.6 + 0.36 + 0.216 + 0.1296 for d = 1..4):
- 1 decode: every d costs 10 ms, so d = 4 gives the most: (1 + 1.3056) / 10 ms.
- 64 decodes: d = 1 costs 12.8 ms for 64 + 38.4 tokens (8.0/ms), d = 2 costs 19.2 ms for
  64 + 61.4 (6.5/ms), no drafts 10 ms for 64 (6.4/ms): d = 1.
- 64 decodes whose drafts are always rejected: nothing gained, so none.
"""

from __future__ import annotations

from quill import SamplingParams
from quill.config import SpeculativeConfig
from quill.contract.plan import StepPlan, StepResult
from quill.engine.admission import StepTimer
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler
from quill.engine.spec_switch import PROBE_INTERVAL, SpeculationSwitch


def _machine() -> StepTimer:
    # Before any measured step the timer takes its feature at its word (a = 0, b = 1).
    return StepTimer(lambda shape: max(0.010, 0.0001 * shape.num_tokens), prior_slope=1.0)


def test_drafts_where_the_pass_is_movement_bound_and_fewer_where_not():
    switch = SpeculationSwitch(4, _machine())
    assert switch.num_drafts(1, 100) == 4
    assert switch.num_drafts(64, 100) == 1
    assert abs(switch.expected_accepted(4) - 1.3056) < 1e-9


def test_off_when_drafts_are_rejected_and_tried_again_now_and_then():
    switch = SpeculationSwitch(4, _machine())
    for _ in range(200):
        switch.on_verified(4, 0)
    choices = [switch.num_drafts(64, 100) for _ in range(PROBE_INTERVAL)]
    assert choices[:-1] == [0] * (PROBE_INTERVAL - 1) and choices[-1] == 4  # one try
    assert switch.num_drafts(64, 100) == 0
    # At one decode a rejected draft costs nothing here, but gains nothing either: no drafts.
    assert switch.num_drafts(1, 100) == 0


def test_no_drafts_when_the_proposer_finds_none():
    switch = SpeculationSwitch(4, _machine())
    switch.on_proposals(1000, 0)
    assert all(switch.num_drafts(1, 100) == 0 for _ in range(PROBE_INTERVAL * 2))


class _Verifier:
    """Accepts the first `accept` drafts of every sequence and adds token 7."""

    def __init__(self, clock: VirtualClock, accept: int) -> None:
        self.clock, self.accept, self.plans = clock, accept, []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.clock.advance(0.01)
        sampled = {}
        for s in plan.seqs:
            if s.samples:
                sampled[s.request_id] = (s.draft_token_ids or [])[: self.accept] + [7]
        return StepResult(sampled)


def _core(accept: int, num_blocks: int = 64, block_size: int = 4):
    clock = VirtualClock()
    kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=True)
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    )
    scheduler = Scheduler(kv, 64, 8, 64, speculative=config)
    executor = _Verifier(clock, accept)
    return EngineCore(scheduler, executor, clock), executor, kv


def _request(rid: str, prompt: list[int], max_tokens: int, **params) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **params), 0.0, max_tokens)


def test_rejected_drafts_free_their_blocks_and_are_never_cached():
    core, executor, kv = _core(accept=0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2, 3]  # ...7 then 1 2 3: drafts 4 5 6 after a 7
    core.add_request(_request("a", prompt, 6))
    while core.has_unfinished_requests():
        core.step()
        request = core.scheduler.requests.get("a")
        if request is not None:
            assert len(kv.block_tables["a"][0]) <= kv.blocks_for(request.num_computed_tokens + 1)
    drafted = [p.seqs[0] for p in executor.plans if p.seqs[0].draft_token_ids]
    assert drafted, "the prompt's repeated run gives drafts"
    # The 7s the executor sampled are the output; no drafted token ever reached the cache:
    # every cached block's tokens are the request's real ones.
    real = prompt + [7] * 6
    hashes = kv.block_hashes(_request("probe", real, 1), len(real) // kv.block_size)
    cached = {h for h in kv.pool.block_hashes if h is not None}
    assert cached and cached <= set(hashes)
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_accepted_drafts_count_as_computed_and_respect_max_tokens():
    core, executor, kv = _core(accept=3)
    prompt = [5, 6, 7, 7, 7, 7, 7, 7]
    core.add_request(_request("a", prompt, 9))
    outputs = []
    while core.has_unfinished_requests():
        out = core.step()
        outputs += [r.output_token_ids for r in out.finished]
    assert outputs == [[7] * 9]  # max_tokens holds though drafts ran ahead
    for plan in executor.plans:
        for s in plan.seqs:
            if s.draft_token_ids:
                # A drafted step never reaches past max_tokens outputs.
                produced = s.start + 1 - s.num_prompt_tokens
                assert produced + len(s.draft_token_ids) + 1 <= 9
                assert s.token_ids[1:] == s.draft_token_ids and s.is_decode
    assert sum(p.num_draft_tokens for p in executor.plans) > 0


def test_no_drafts_for_penalties_structure_or_short_of_min_tokens():
    core, executor, _ = _core(accept=3)
    prompt = [5, 6, 7, 7, 7, 7, 7, 7]
    core.add_request(_request("pen", prompt, 6, repetition_penalty=1.2))
    core.add_request(_request("min", prompt, 6, min_tokens=4))
    while core.has_unfinished_requests():
        core.step()
    by_step = [{s.request_id: s.draft_token_ids for s in p.seqs} for p in executor.plans]
    assert all(step.get("pen") is None for step in by_step)
    produced_before = []
    for plan in executor.plans:
        for s in plan.seqs:
            if s.request_id == "min" and s.samples:
                produced = s.start + s.num_tokens - s.num_drafts - s.num_prompt_tokens
                produced_before.append((produced, s.draft_token_ids))
    # Drafts only once min_tokens were produced.
    assert all(d is None for n, d in produced_before if n < 4)
    assert any(d for n, d in produced_before if n >= 4)
