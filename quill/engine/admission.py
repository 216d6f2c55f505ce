"""Admission that keeps its promises: refuse at once what would start too late. No torch.

With a TTFT SLO set, a new request's wait before its first token is predicted when it arrives:
the prompt tokens ahead of it (running requests' unfinished prompts, and the waiting requests
the policy puts before it) plus its own (less what the prefix cache already holds) are cut
into steps of the token budget left beside the running decodes, and each step is priced. If
the prediction exceeds the SLO the request is refused (the server answers 503 with
Retry-After) instead of being queued to time out; requests already admitted are never dropped
for it. Every admitted request carries its prediction, so it can be set beside the actual TTFT.

Steps are priced by the cost model scaled by how recent steps measured against it, or, without
a hardware spec, by a line fit to recent step times (`MeasuredStepTimer`). What the prediction
leaves out: the step already running, KV-pool and max_num_seqs limits on admission, and
decodes joining or leaving while the request waits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

from quill.cost.batch import BatchShape
from quill.engine.request import Request
from quill.engine.request_queue import priority_key
from quill.errors import QuillError


class OverloadedError(QuillError):
    """The request would wait past its TTFT SLO (HTTP 503 with Retry-After)."""

    def __init__(self, message: str, retry_after: float) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after


class StepTimer(Protocol):
    def seconds(self, shape: BatchShape) -> float: ...

    def on_step(self, plan, start: float, end: float) -> None: ...


class CostModelStepTimer:
    """The cost model's price, times an exponential average of measured / predicted."""

    def __init__(self, cost_model, smoothing: float = 0.1) -> None:
        self.cost_model = cost_model
        self.smoothing = smoothing
        self.ratio = 1.0

    def seconds(self, shape: BatchShape) -> float:
        return self.cost_model.price(shape).predicted_s * self.ratio

    def on_step(self, plan, start: float, end: float) -> None:
        predicted = self.cost_model.price(BatchShape.from_plan(plan)).predicted_s
        if predicted > 0 and end > start:
            self.ratio += self.smoothing * ((end - start) / predicted - self.ratio)


class MeasuredStepTimer:
    """Step seconds as a + b * tokens, least squares over recent steps weighted by `decay`**age.
    Knows nothing (0 s) until a step has run."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._xx = self._y = self._xy = 0.0

    def on_step(self, plan, start: float, end: float) -> None:
        x, y, d = float(plan.num_tokens), end - start, self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._xx = self._xx * d + x * x
        self._y = self._y * d + y
        self._xy = self._xy * d + x * y

    def coefficients(self) -> tuple[float, float]:
        w, x, xx, y, xy = self._w, self._x, self._xx, self._y, self._xy
        if w == 0:
            return 0.0, 0.0
        det = w * xx - x * x
        if det <= 1e-9 * w * xx:  # every step had the same size: no slope to see
            return 0.0, (y / x if x else 0.0)
        slope = max((w * xy - x * y) / det, 0.0)
        return max((y - slope * x) / w, 0.0), slope

    def seconds(self, shape: BatchShape) -> float:
        intercept, slope = self.coefficients()
        return intercept + slope * shape.num_tokens


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
        policy: str = "fcfs",
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

    def on_step(self, plan, start: float, end: float) -> None:
        self.timer.on_step(plan, start, end)

    def order_key(self, request: Request) -> tuple:
        if self.policy == "fcfs":
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
        self, request: Request, num_cached: int, state: QueueState, pending: list[Request]
    ) -> None:
        """Set `request.predicted_ttft`; raise OverloadedError if it is past the request's SLO
        (`slo_s`, or the request's own when tighter; none: every request is admitted).
        `pending`: requests added, not yet seen by the scheduler."""
        slo = self.slo_s
        if request.ttft_slo is not None:
            slo = request.ttft_slo if slo is None else min(slo, request.ttft_slo)
        key = self.order_key(request)
        ahead = state.running_prefill_tokens
        ahead += sum(tokens for k, tokens in state.waiting if k <= key)
        ahead += sum(r.num_tokens for r in pending if self.order_key(r) <= key)
        predicted = self.predict(request.num_tokens - num_cached, ahead, state)
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
