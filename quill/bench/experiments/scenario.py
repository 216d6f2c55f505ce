"""Streams decoding, then a long prompt arrives: the same script played on the real engine
(wall clock) and on the simulator's replica (virtual clock), every token timestamped.

Both sides are driven step by step by one function, so the two timelines differ only in what
a step costs: the engine's measured time against the cost model's price of the same plan.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field

STREAM_PREFIX = "stream-"
NEWCOMER = "long-prompt"


@dataclass
class Script:
    streams: int = 16
    stream_prompt: int = 64
    long_prompt: int = 2000
    long_reply: int = 8
    steps_before: int = 8  # decode steps of the streams alone before the prompt arrives
    steps_after: int = 8  # steps after the newcomer's first token
    stream_reply: int = 256  # more than the script needs: the streams are aborted at its end


@dataclass
class Timeline:
    """Token times per request (seconds on the side's clock), the newcomer's arrival, and per
    step (end time, prompt tokens, decode tokens)."""

    token_times: dict[str, list[float]] = field(default_factory=dict)
    arrival: float = 0.0
    steps: list[tuple[float, int, int]] = field(default_factory=list)

    def first_token(self, request_id: str) -> float | None:
        times = self.token_times.get(request_id)
        return times[0] if times else None

    def shifted(self) -> dict:
        """JSON-ready, every time measured from the newcomer's arrival."""
        t0 = self.arrival
        return {
            "token_times": {k: [t - t0 for t in v] for k, v in self.token_times.items()},
            "steps": [[end - t0, pre, dec] for end, pre, dec in self.steps],
        }


class RealSide:
    """The engine, timed by the wall clock as a client of `engine.step()` would see it."""

    def __init__(self, engine, budget: int, seed: int = 0) -> None:
        self.engine = engine
        self.budget = budget
        self.rng = random.Random(seed)
        self.ids: list[str] = []
        self.saved = engine.token_budget

    def now(self) -> float:
        return time.monotonic()

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        from quill.bench.client import random_prompt
        from quill.contract.sampling_params import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        prompt = random_prompt(prompt_tokens, self.rng, range(100, 40000))
        self.engine.add_request(prompt, params, request_id=request_id)
        self.ids.append(request_id)

    def step(self, timeline: Timeline) -> None:
        outputs, stats = self.engine.step_with_stats()
        now = time.monotonic()
        for out in outputs:
            new = len(out.outputs[0].delta_token_ids)
            timeline.token_times.setdefault(out.request_id, []).extend([now] * new)
        if stats is not None:
            timeline.steps.append((now, stats.num_prefill_tokens, stats.num_decode_tokens))

    def __enter__(self) -> RealSide:
        self.saved = self.engine.token_budget
        self.engine.set_token_budget(self.budget)
        return self

    def __exit__(self, *exc) -> None:
        for rid in self.ids:
            self.engine.abort_request(rid)
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.engine.set_token_budget(self.saved)


class SimSide:
    """One simulated replica (the engine's own core and scheduler), in virtual time."""

    def __init__(self, config) -> None:
        from quill.sim.metrics import MetricsSink
        from quill.sim.replica import Replica

        self.replica = Replica(config, MetricsSink())

    def now(self) -> float:
        return self.replica.clock.t

    def add(self, request_id: str, prompt_tokens: int, max_tokens: int) -> None:
        from quill.sim.workload import WorkItem

        item = WorkItem(request_id, self.now(), prompt_tokens, max_tokens)
        self.replica.core.add_request(self.replica.make_request(item))

    def step(self, timeline: Timeline) -> None:
        out = self.replica.core.step()
        now = self.now()
        for request in out.advanced:
            timeline.token_times.setdefault(request.request_id, []).append(now)
        stats = out.stats
        if stats is not None:
            timeline.steps.append((now, stats.num_prefill_tokens, stats.num_decode_tokens))

    def __enter__(self) -> SimSide:
        return self

    def __exit__(self, *exc) -> None:
        pass


def play(side, script: Script, progress: Callable[[], None] | None = None) -> Timeline:
    """The script on one side: the streams start and get their first tokens, decode alone
    for a while, the long prompt arrives, and the run ends a few steps after its first token."""
    timeline = Timeline()
    streams = stream_ids(script)
    limit = 100 * (script.steps_before + script.steps_after) + script.long_prompt

    def step() -> None:
        side.step(timeline)
        if progress is not None:
            progress()

    with side:
        for rid in streams:
            side.add(rid, script.stream_prompt, script.stream_reply)
        for _ in range(limit):
            if all(timeline.token_times.get(rid) for rid in streams):
                break
            step()
        for _ in range(script.steps_before):
            step()
        timeline.arrival = side.now()
        side.add(NEWCOMER, script.long_prompt, script.long_reply)
        for _ in range(limit):
            if timeline.first_token(NEWCOMER) is not None:
                break
            step()
        for _ in range(script.steps_after):
            step()
    return timeline


def stream_ids(script: Script) -> list[str]:
    return [f"{STREAM_PREFIX}{i}" for i in range(script.streams)]
