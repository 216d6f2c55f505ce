"""A request whose step fails is failed alone: the others in the step carry on unchanged."""

from __future__ import annotations

import logging
from collections.abc import Iterable

import pytest
import torch

from quill import SamplingParams
from quill.contract.plan import SeqPlan, StepPlan, StepResult
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler
from quill.model.sampler import Sampler
from tests.conftest import PROMPTS

NUM_BLOCKS = 32


class _PoisonableExecutor:
    """Tokens depend only on the request and position; any plan with a poisoned request raises."""

    def __init__(self, poisoned: Iterable[str] = ()) -> None:
        self.poisoned = set(poisoned)
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        bad = [s.request_id for s in plan.seqs if s.request_id in self.poisoned]
        if bad:
            raise RuntimeError(f"cannot run {bad}")
        sampled = {s.request_id: [_token(s)] for s in plan.seqs if s.samples}
        return StepResult(sampled, {rid: [(-1.0, [])] for rid in sampled})


def _token(seq: SeqPlan) -> int:
    return (sum(map(ord, seq.request_id)) * 31 + seq.context_len) % 1000


class _Listener:
    def __init__(self) -> None:
        self.plans: list[StepPlan] = []

    def on_step(self, plan: StepPlan, start: float, end: float) -> None:
        self.plans.append(plan)


_PROMPTS = {"a": list(range(10)), "b": [1, 2], "c": list(range(20, 33)), "p": list(range(40, 47))}


def _core(executor, listener=None) -> EngineCore:
    # A budget of 8 tokens: prompts go in chunks, so a step mixes prefill chunks and decodes.
    scheduler = Scheduler(KVCacheManager(NUM_BLOCKS, 4), 8, 8, 64)
    return EngineCore(scheduler, executor, VirtualClock(), [listener] if listener else [])


def _run(core: EngineCore, ids: list[str], max_tokens: int = 5) -> dict[str, Request]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for rid in ids:
        core.add_request(Request(rid, _PROMPTS[rid], params, 0.0, max_tokens))
    finished: dict[str, Request] = {}
    while core.has_unfinished_requests():
        for request in core.step().finished:
            assert request.request_id not in finished, "reported finished twice"
            finished[request.request_id] = request
    return finished


def test_a_poisoned_request_fails_alone(caplog):
    clean = _run(_core(_PoisonableExecutor()), ["a", "b", "c"])
    listener = _Listener()
    executor = _PoisonableExecutor({"p"})
    core = _core(executor, listener)
    with caplog.at_level(logging.ERROR, logger="quill.engine.core"):
        finished = _run(core, ["a", "p", "b", "c"])
    for rid in "abc":
        assert finished[rid].finish_reason == "length"
        assert finished[rid].output_token_ids == clean[rid].output_token_ids
    poisoned = finished["p"]
    assert poisoned.finish_reason == "error" and "cannot run ['p']" in poisoned.error
    assert poisoned.output_token_ids == []
    # Logged once, naming the failed request, with the traceback.
    records = [r for r in caplog.records if r.name == "quill.engine.core"]
    assert len(records) == 1 and records[0].exc_info
    assert "failing request(s) p (" in records[0].getMessage()
    # One step, one report: the listener saw each step once, never with the failed request.
    assert len(listener.plans) == len({p.step_id for p in executor.plans})
    assert all(s.request_id != "p" for plan in listener.plans for s in plan.seqs)
    assert core.last_plan is listener.plans[-1]
    # No KV block leaked, and the engine keeps serving.
    assert core.scheduler.kv.pool.num_free_blocks == NUM_BLOCKS
    again = _run(core, ["c"])
    assert again["c"].output_token_ids == clean["c"].output_token_ids
    assert core.scheduler.kv.pool.num_free_blocks == NUM_BLOCKS


def test_retries_run_each_sequence_alone_and_pass_on_ended_ids():
    executor = _PoisonableExecutor()
    core = _core(executor)
    _run(core, ["b"], max_tokens=1)  # "b" ends: the next plan carries its id
    executor.poisoned = {"p"}
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    core.add_request(Request("a", [1, 2, 3], params, 0.0, 2))
    core.add_request(Request("p", [4, 5], params, 0.0, 2))
    out = core.step()
    batch, *retries = executor.plans[-3:]
    assert [s.request_id for s in batch.seqs] == ["a", "p"] and batch.finished_request_ids == ["b"]
    assert [[s.request_id for s in r.seqs] for r in retries] == [["a"], ["p"]]
    assert retries[0].finished_request_ids == ["b"] and retries[1].finished_request_ids == []
    assert {r.step_id for r in (batch, *retries)} == {batch.step_id}
    assert [r.request_id for r in out.advanced] == ["a"]
    assert [(r.request_id, r.finish_reason) for r in out.finished] == [("p", "error")]
    assert core.last_step.num_scheduled_requests == 1


def test_a_failed_single_request_step_hands_ended_ids_to_the_next_plan():
    executor = _PoisonableExecutor()
    core = _core(executor)
    _run(core, ["b"], max_tokens=1)
    executor.poisoned = {"p"}
    core.add_request(Request("p", [4, 5], SamplingParams(max_tokens=2), 0.0, 2))
    before = core.last_step
    out = core.step()
    assert [(r.request_id, r.finish_reason) for r in out.finished] == [("p", "error")]
    assert core.last_step is before  # nothing ran: no step to report
    assert len(executor.plans[-1].seqs) == 1  # no retry of a lone sequence
    _run(core, ["a"], max_tokens=1)
    # "b" is told again (the failed pass may have missed it), with "p", which ended since.
    assert executor.plans[-2].finished_request_ids == ["b", "p"]


def test_a_request_ended_while_scheduling_is_reported_once():
    # Two blocks of 4: "a" (7 tokens) runs out of room alone and ends; "b" then gets in.
    core = EngineCore(Scheduler(KVCacheManager(2, 4), 16, 4, 64), _PoisonableExecutor())
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    core.add_request(Request("a", list(range(7)), params, 0.0, 5))
    core.add_request(Request("b", [1, 2, 3], SamplingParams(max_tokens=2), 0.0, 2))
    ended = []
    while core.has_unfinished_requests():
        ended += [r.request_id for r in core.step().finished]
    assert sorted(ended) == ["a", "b"]


def test_sampler_failure_leaves_seeded_generators_as_they_were():
    def seq(rid: str, seed: int) -> SeqPlan:
        params = SamplingParams(temperature=1.0, seed=1)
        object.__setattr__(params, "seed", seed)  # past validation, as a corrupted plan might
        return SeqPlan(rid, [1], 3, 3, [[0]], True, params)

    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    alone = Sampler(torch.device("cpu"))
    expected = [alone(logits[:1], [seq("good", 7)]).token_ids[0] for _ in range(3)]
    sampler = Sampler(torch.device("cpu"))
    sampler(logits[:1], [seq("good", 7)])  # the generator exists and has moved on once
    with pytest.raises(ValueError, match="Overflow"):
        sampler(logits, [seq("good", 7), seq("bad", 2**70)])
    assert "bad" not in sampler.request_generators
    assert [sampler(logits[:1], [seq("good", 7)]).token_ids[0] for _ in range(2)] == expected[1:]


def test_poisoned_request_among_real_ones(llm):
    engine = llm.engine
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[4]]
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    clean = [o.outputs[0] for o in llm.generate(prompts, greedy, use_tqdm=False)]
    # A seed torch cannot take, set after validation: the real sampler raises on it.
    poison = SamplingParams(max_tokens=6, temperature=0.8, seed=5, ignore_eos=True)
    object.__setattr__(poison, "seed", 2**70)
    ids = [engine.add_request(prompts[0], greedy), engine.add_request(PROMPTS[3], poison)]
    ids += [engine.add_request(p, greedy) for p in prompts[1:]]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    healthy = [final[rid].outputs[0] for rid in ids[:1] + ids[2:]]
    assert [o.text for o in healthy] == [o.text for o in clean]
    assert [o.token_ids for o in healthy] == [o.token_ids for o in clean]
    assert all(o.finish_reason == "length" for o in healthy)
    bad = final[ids[1]]
    assert bad.outputs[0].finish_reason == "error" and "Overflow" in bad.error
    assert engine.scheduler.kv.usage == 0
    assert ids[1] not in engine.runner.sampler.request_generators
    # And the engine serves on.
    again = llm.generate(prompts[:1], greedy, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == clean[0].token_ids
