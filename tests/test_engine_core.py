"""The seam between deciding and doing: the torch-free engine core and the step plan."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from quill import SamplingParams
from quill.contract.plan import SeqPlan, StepPlan, StepResult
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.record import read_steps
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler
from tests.conftest import write_tiny_config


def test_core_and_plan_import_no_torch():
    code = (
        "import sys; import quill.engine.core, quill.contract.plan, quill.engine.scheduler, "
        "quill.engine.block_pool, quill.engine.request, quill.engine.record, "
        "quill.engine.llm_engine, quill.engine_args; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def _seq(start: int, n: int, num_prompt: int) -> SeqPlan:
    return SeqPlan("r", list(range(n)), start, num_prompt, [[0]], samples=True)


def test_what_counts_as_decode():
    assert _seq(start=10, n=1, num_prompt=10).is_decode  # the token after the prompt
    assert _seq(start=12, n=1, num_prompt=10).is_decode
    assert _seq(start=9, n=1, num_prompt=10).is_prefill  # a one-token prompt chunk
    assert _seq(start=0, n=12, num_prompt=10).is_prefill  # a preempted request recomputed
    assert _seq(start=10, n=2, num_prompt=10).is_prefill  # recomputing outputs only
    plan = StepPlan(0, [_seq(10, 1, 10), _seq(0, 7, 7), _seq(5, 1, 3)])
    assert (plan.num_tokens, plan.num_decode_tokens, plan.num_prefill_tokens) == (9, 2, 7)


class _CountingExecutor:
    """Returns token 100 + step id for every sampling sequence and keeps the plans it saw."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.clock.advance(0.5)
        return StepResult({s.request_id: [100 + plan.step_id] for s in plan.seqs if s.samples})


def test_core_runs_on_any_executor_and_clock():
    clock = VirtualClock()
    executor = _CountingExecutor(clock)
    scheduler = Scheduler(KVCacheManager(16, 4), 8, 4, 64)
    core = EngineCore(scheduler, executor, clock)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(Request("a", list(range(10)), params, 0.0, 3))
    core.add_request(Request("b", [1, 2], params, 0.0, 3))
    finished = []
    while core.has_unfinished_requests():
        finished += core.step().finished
    # Budget 8: "a" takes a chunk of 8, then its last 2 prompt tokens beside b's prompt.
    shapes = [[(s.request_id, s.start, s.num_tokens) for s in p.seqs] for p in executor.plans]
    assert shapes == [
        [("a", 0, 8)],
        [("a", 8, 2), ("b", 0, 2)],
        [("a", 10, 1), ("b", 2, 1)],
        [("a", 11, 1), ("b", 3, 1)],
    ]
    a = next(r for r in finished if r.request_id == "a")
    assert a.output_token_ids == [101, 102, 103]
    # Times come from the executor's virtual clock: the first token lands at the end of step 1.
    assert (a.times.first_token, a.times.finished) == (1.0, 2.0)
    assert a.times.itl_sum == pytest.approx(1.0)
    assert executor.plans[-1].finished_request_ids == []
    # The decode tokens are the tokens sampled one step earlier.
    assert executor.plans[2].seqs[0].token_ids == [101]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, model_dir):
    directory = tmp_path_factory.mktemp("tiny")
    write_tiny_config(directory, model_dir)
    return directory


class _OverTheWire:
    """Sends every plan through JSON before the real executor sees it."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.num_plans = 0

    def execute(self, plan: StepPlan) -> StepResult:
        wire = json.dumps(plan.to_dict())
        self.num_plans += 1
        return self.runner.execute(StepPlan.from_dict(json.loads(wire)))


def test_plan_is_all_the_model_needs(tiny_dir, model_dir, tmp_path):
    from quill import LLM

    def make():
        return LLM(
            str(tiny_dir),
            load_format="dummy",
            tokenizer=str(model_dir),
            dtype="float32",
            quantization="none",
            max_num_batched_tokens=16,
            kv_cache_memory=1 << 20,
            record_steps=str(tmp_path / "steps.jsonl"),
        )

    prompts = [[5, 6, 7] * 9, [8] * 4, list(range(30, 52))]
    params = [
        SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=5, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=4, repetition_penalty=1.3, seed=1, ignore_eos=True),
    ]
    direct = make().generate(prompts, params, use_tqdm=False)
    (tmp_path / "steps.jsonl").unlink()
    wired = make()
    wired.engine.core.executor = _OverTheWire(wired.engine.runner)
    remote = wired.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in remote] == [o.outputs[0].token_ids for o in direct]
    assert remote[1].outputs[0].logprobs == direct[1].outputs[0].logprobs

    steps = read_steps(tmp_path / "steps.jsonl")
    assert len(steps) == wired.engine.core.executor.num_plans
    assert all(s["num_tokens"] <= 16 and s["duration"] > 0 for s in steps)
    assert sum(s["num_tokens"] - s["num_decode_tokens"] for s in steps) == sum(map(len, prompts))
    assert sum(s["num_decode_tokens"] for s in steps) == (6 - 1) + (5 - 1) + (4 - 1)


def test_queued_adds_are_taken_early_only_when_nothing_else_is_queued():
    """`take_pending_adds` moves queued adds into the waiting queue as a step would first;
    with an abort queued beside them it moves nothing (the step takes both, in order)."""
    clock = VirtualClock()
    core = EngineCore(Scheduler(KVCacheManager(16, 4), 8, 4, 64), _CountingExecutor(clock), clock)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    core.add_request(Request("a", [1, 2], params, 0.0, 3))
    core.abort_request("a")
    assert not core.take_pending_adds()
    assert core.has_pending and core.scheduler.num_waiting == 0
    assert [r.request_id for r in core.step().finished] == ["a"]  # added, then aborted
    core.add_request(Request("b", [1, 2], params, 0.0, 3))
    core.add_request(Request("c", [3, 4], params, 0.0, 3))
    assert core.take_pending_adds()
    assert not core.has_pending
    assert [r.request_id for r in core.scheduler.waiting] == ["b", "c"]
