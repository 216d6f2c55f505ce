"""Admission control: the predicted TTFT by hand, refusal exactly past the SLO, admitted requests
never dropped, and the step-time fit (torch-free)."""

from __future__ import annotations

import pytest

from quill.contract.errors import OverloadedError
from quill.contract.plan import SeqPlan, StepResult
from quill.contract.sampling_params import SamplingParams
from quill.cost.batch import BatchShape
from quill.engine.admission import AdmissionControl, QueueState, StepTimer
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler


class LinearTimer:
    """A step costs 10 ms plus 1 ms per token."""

    def seconds(self, shape: BatchShape) -> float:
        return 0.010 + 0.001 * shape.num_tokens

    def on_step(self, plan, start, end) -> None:
        pass


def request(rid: str, prompt: int, arrival: float = 0.0, slo: float | None = None) -> Request:
    return Request(rid, [7] * prompt, SamplingParams(max_tokens=4), arrival, 4, ttft_slo=slo)


# 4 decodes running, 1000 prompt tokens ahead, a budget of 256: 252 prompt tokens a step.
# A 200-token prompt ends in step 5: 4 full steps of 256 tokens (0.266 s each; 1008 prompt
# tokens) and one of the last 192 + 4 decodes = 196 tokens (0.206 s): 1.270 s.
STATE = QueueState(
    num_decodes=4, decode_context=100, running_prefill_tokens=600, waiting=(((0.0,), 400),)
)
PREDICTED = 4 * (0.010 + 0.256) + (0.010 + 0.196)


def test_prediction_by_hand():
    control = AdmissionControl(None, LinearTimer(), token_budget=256)
    r = request("r", 200, arrival=1.0)
    control.admit(r, 0, STATE, [])
    assert r.predicted_ttft == pytest.approx(PREDICTED)
    # 48 cached tokens leave 152 to compute: 1000 + 152 = 4 full steps and 144 (+4 decodes).
    cached = request("c", 200, arrival=1.0)
    control.admit(cached, 48, STATE, [])
    assert cached.predicted_ttft == pytest.approx(4 * 0.266 + 0.010 + 0.148)


@pytest.mark.parametrize("slo, refused", [(PREDICTED * 1.0001, False), (PREDICTED * 0.9999, True)])
def test_refuses_exactly_when_the_prediction_exceeds_the_slo(slo, refused):
    control = AdmissionControl(slo, LinearTimer(), token_budget=256)
    r = request("r", 200, arrival=1.0)
    if refused:
        with pytest.raises(OverloadedError) as e:
            control.admit(r, 0, STATE, [])
        assert e.value.retry_after == pytest.approx(PREDICTED - slo)
        assert f"{PREDICTED:.2f} s" in e.value.message
        assert control.num_refused == 1
    else:
        control.admit(r, 0, STATE, [])
        assert control.num_refused == 0


def test_a_request_slo_tightens_the_servers():
    control = AdmissionControl(100.0, LinearTimer(), token_budget=256)
    with pytest.raises(OverloadedError):
        control.admit(request("r", 200, arrival=1.0, slo=1.0), 0, STATE, [])
    control.admit(request("s", 200, arrival=1.0, slo=2.0), 0, STATE, [])


def test_priority_counts_only_the_requests_ahead():
    control = AdmissionControl(None, LinearTimer(), 256, policy="priority", priority_aging=10.0)
    # Waiting: one request with key 5 (ahead of a priority-0 arrival at 6), one with key 50.
    state = QueueState(0, 0, 0, (((5.0,), 300), ((50.0,), 1000)))
    r = request("r", 100, arrival=6.0)
    pending = [request("p", 56, arrival=5.5)]
    control.admit(r, 0, state, pending)
    # 300 + 56 + 100 = 456 tokens: one full step of 256 and one of 200.
    assert r.predicted_ttft == pytest.approx(0.266 + 0.210)


class FakeExecutor:
    def execute(self, plan):
        return StepResult({s.request_id: [1] for s in plan.seqs if s.samples})


class StepClock:
    """Virtual time that moves 0.05 s at every reading (a step reads it at its start and end)."""

    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        self.t += 0.05
        return self.t


def test_core_refuses_new_requests_but_never_drops_admitted_ones():
    timer = StepTimer.by_tokens()
    control = AdmissionControl(0.5, timer, token_budget=32)
    scheduler = Scheduler(KVCacheManager(256, 4), 32, 8, 1000)
    core = EngineCore(scheduler, FakeExecutor(), StepClock(), admission=control)
    core.add_request(request("a", 200))  # nothing measured yet: predicted 0, admitted
    core.step()
    assert timer.coefficients() != (0.0, 0.0)
    with pytest.raises(OverloadedError):  # 168 tokens ahead + 200: far past 0.5 s
        core.add_request(request("b", 200))
    assert "b" not in scheduler.requests and core.num_unscheduled == 0
    finished = []
    while core.has_unfinished_requests():
        finished += core.step().finished
    assert [r.request_id for r in finished] == ["a"] and finished[0].finish_reason == "length"
    core.add_request(request("c", 8))  # the queue is empty again: admitted
    assert scheduler.num_waiting + core.num_unscheduled >= 1


class Plan:
    """Just enough of a StepPlan for BatchShape.from_plan: n prompt tokens of one sequence."""

    def __init__(self, n: int) -> None:
        self.seqs = [SeqPlan("r", [1] * n, 0, n, [[0]], True)]


def test_timer_fits_a_line_through_token_counts():
    timer = StepTimer.by_tokens()
    assert timer.seconds(BatchShape.prefills(1, 100)) == 0.0  # knows nothing yet
    for n in (1, 40, 7, 300, 12, 64):
        timer.on_step(Plan(n), 0.0, 0.004 + 0.0005 * n)
    intercept, slope = timer.coefficients()
    assert intercept == pytest.approx(0.004) and slope == pytest.approx(0.0005)
    assert timer.seconds(BatchShape.prefills(1, 100)) == pytest.approx(0.054)


def test_timer_corrects_the_cost_model_for_small_and_large_steps():
    class Cost:  # a stale calibration: 1 ms a step plus 1 ms per token
        def price(self, shape):
            return type("StepCost", (), {"predicted_s": 0.001 + 0.001 * shape.num_tokens})

    timer = StepTimer.from_cost_model(Cost())
    assert timer.seconds(BatchShape.prefills(1, 99)) == pytest.approx(0.1)  # at its word
    # The machine really takes 20 ms a step plus 2 ms per token: 2 x price + 18 ms.
    for n in (1, 3, 256, 512, 1, 128):
        timer.on_step(Plan(n), 0.0, 0.020 + 0.002 * n)
    assert timer.seconds(BatchShape.prefills(1, 99)) == pytest.approx(0.218)
    assert timer.seconds(BatchShape.decodes(4, 10)) == pytest.approx(0.028)


def test_a_request_arriving_mid_step_counts_what_that_step_took_in():
    """The snapshot is taken after each step; a request arriving while a step runs must still
    count the requests that step took from the queue."""
    seen = {}

    class ArrivalMidStep(FakeExecutor):
        def execute(self, plan):
            if "late" not in seen:
                late = request("late", 10)
                core.add_request(late)  # as the server's thread would, during the pass
                seen["late"] = late.predicted_ttft
            return super().execute(plan)

    control = AdmissionControl(None, LinearTimer(), token_budget=32)
    scheduler = Scheduler(KVCacheManager(256, 4), 32, 8, 1000)
    core = EngineCore(scheduler, ArrivalMidStep(), StepClock(), admission=control)
    core.add_request(request("early", 100))
    core.step()
    # Ahead of "late": all 100 of "early" (the snapshot predates it) and its own 10: 110 tokens,
    # 3 steps of 32 and one of 14; the step running is waited out first (mean step 0 s here).
    assert seen["late"] == pytest.approx(3 * (0.010 + 0.032) + 0.010 + 0.014)
