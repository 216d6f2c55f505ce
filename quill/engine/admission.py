"""Admission that keeps its promises: refuse at once what would start too late. No torch.

With a TTFT SLO set, a new request's wait before its first token is predicted when it arrives:
the prompt tokens ahead of it (running requests' unfinished prompts, and the waiting requests
the policy puts before it) plus its own (less what the prefix cache already holds) are cut
into steps of the token budget left beside the running decodes, and each step is priced. If
the prediction exceeds the SLO the request is refused (the server answers 503 with
Retry-After) instead of being queued to time out; requests already admitted are never dropped
for it. Every admitted request carries its prediction, so it can be set beside the actual TTFT.

Steps are priced by the cost model, corrected by a line fit of recent steps' measured times
against its prices, or, without a hardware spec, by a line fit of step times against their
token counts (`StepTimer`); the rest of the step
now running (by the mean step time) comes first. What the prediction leaves out: KV-pool and
max_num_seqs limits on admission, decodes joining or leaving while the request waits, and
attention's growth over a long prompt's later chunks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from quill.config import SchedulingPolicy
from quill.contract.errors import OverloadedError
from quill.cost.batch import BatchShape
from quill.engine.request import Request
from quill.engine.request_queue import priority_key


class StepTimer:
    """Step seconds as a + b * x, where x is a number the step is priced by: the cost model's
    price (`StepTimer.from_cost_model`) or its token count (`StepTimer.by_tokens`), without a
    hardware spec). a and b are a least-squares fit over recent steps, weighted by
    `decay`**age, so a stale calibration is corrected for small steps and large ones alike.
    Before any step: a = 0 and b = `prior_slope` (1: take the cost model at its word)."""

    def __init__(
        self, feature: Callable[[BatchShape], float], prior_slope: float, decay: float = 0.98
    ) -> None:
        self.feature = feature
        self.prior_slope = prior_slope
        self.decay = decay
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    @classmethod
    def from_cost_model(cls, cost_model) -> StepTimer:
        return cls(lambda shape: cost_model.price(shape).predicted_s, prior_slope=1.0)

    @classmethod
    def by_tokens(cls) -> StepTimer:
        return cls(lambda shape: float(shape.num_tokens), prior_slope=0.0)

    def on_step(self, plan, start: float, end: float) -> None:
        x, y, d = self.feature(BatchShape.from_plan(plan)), end - start, self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._xx = self._xx * d + x * x
        self._y = self._y * d + y
        self._xy = self._xy * d + x * y

    def coefficients(self) -> tuple[float, float]:
        w, x, xx, y, xy = self._w, self._x, self._xx, self._y, self._xy
        if w == 0:
            return 0.0, self.prior_slope
        det = w * xx - x * x
        if det <= 1e-9 * w * xx:  # every step had the same size: no slope to see
            return 0.0, (y / x if x else self.prior_slope)
        slope = max((w * xy - x * y) / det, 0.0)
        return max((y - slope * x) / w, 0.0), slope

    def seconds(self, shape: BatchShape) -> float:
        intercept, slope = self.coefficients()
        return intercept + slope * self.feature(shape)


@dataclass(frozen=True)
class QueueState:
    """What the scheduler held after the last step (published by the engine thread)."""

    num_decodes: int = 0
    decode_context: int = 0  # mean context of the decodes
    running_prefill_tokens: int = 0  # running requests' tokens still to compute, past decodes
    # Waiting requests as (order key, tokens to compute), in the queue's order.
    waiting: tuple[tuple[tuple, int], ...] = ()


class AdmissionControl:
    """Predicts each new request's TTFT and refuses it when the prediction exceeds its SLO."""

    def __init__(
        self,
        slo_s: float | None,
        timer: StepTimer,
        token_budget: int,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        priority_aging: float = math.inf,
    ) -> None:
        if slo_s is not None and not (slo_s > 0 and math.isfinite(slo_s)):
            raise ValueError(f"the TTFT SLO must be a positive number of seconds, got {slo_s}")
        self.slo_s = slo_s
        self.timer = timer
        self.token_budget = token_budget
        self.policy = policy
        self.priority_aging = priority_aging
        self.num_refused = 0
        self.step_s = 0.0  # recent steps' mean duration (exponential average)

    def on_step(self, plan, start: float, end: float) -> None:
        self.timer.on_step(plan, start, end)
        self.step_s += 0.2 * ((end - start) - self.step_s)

    def order_key(self, request: Request) -> tuple:
        if self.policy == SchedulingPolicy.FCFS:
            return (request.arrival_time,)
        return priority_key(request.priority, request.arrival_time, self.priority_aging)

    def snapshot(self, scheduler) -> QueueState:
        decodes = context = prefill = 0
        for r in scheduler.running:
            left = r.num_tokens - r.num_computed_tokens
            if left <= 1 and r.num_computed_tokens >= r.num_prompt_tokens:
                decodes += 1
                context += r.num_computed_tokens
            else:
                prefill += left
        waiting = tuple((self.order_key(r), r.num_tokens) for r in scheduler.waiting)
        return QueueState(decodes, context // decodes if decodes else 0, prefill, waiting)

    def predict(self, own_tokens: int, tokens_ahead: int, state: QueueState) -> float:
        """Seconds until the last of `tokens_ahead + own_tokens` prompt tokens is computed."""
        decodes = min(state.num_decodes, self.token_budget - 1)
        per_step = self.token_budget - decodes
        full, last = divmod(tokens_ahead + own_tokens, per_step)
        contexts = [state.decode_context] * decodes

        def step(prefill: int) -> float:
            return self.timer.seconds(BatchShape.abstract([(prefill, 0)], contexts))

        return full * step(per_step) + (step(last) if last else 0.0)

    def admit(
        self,
        request: Request,
        num_cached: int,
        state: QueueState,
        pending: list[Request],
        step_elapsed: float | None = None,
    ) -> None:
        """Set `request.predicted_ttft`; raise OverloadedError if it is past the request's SLO
        (`slo_s`, or the request's own when tighter; none: every request is admitted).
        `pending`: requests added since `state` was taken; `step_elapsed`: how long the step
        now running has run (None: none is), which the request waits out first."""
        slo = self.slo_s
        if request.ttft_slo is not None:
            slo = request.ttft_slo if slo is None else min(slo, request.ttft_slo)
        key = self.order_key(request)
        ahead = state.running_prefill_tokens
        ahead += sum(tokens for k, tokens in state.waiting if k <= key)
        ahead += sum(r.num_tokens for r in pending if self.order_key(r) <= key)
        predicted = self.predict(request.num_tokens - num_cached, ahead, state)
        if step_elapsed is not None:
            predicted += max(self.step_s - step_elapsed, 0.0)
        request.predicted_ttft = predicted
        if slo is not None and predicted > slo:
            self.num_refused += 1
            raise OverloadedError(
                f"The server is too busy to start this request within its TTFT SLO: the "
                f"predicted time to first token is {predicted:.2f} s ({ahead} prompt tokens "
                f"ahead of its {request.num_tokens - num_cached} to compute), over the SLO of "
                f"{slo:.2f} s. Please retry later.",
                retry_after=predicted - slo,
            )
