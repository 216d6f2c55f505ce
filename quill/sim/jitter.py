"""Step-to-step jitter: a simulated step takes its price times a ratio drawn from the ratios
the calibration measured (measured / predicted over the steps it was fitted on), so that the
simulator's inter-token gaps and queues have the spread a real engine's have, not only their
typical size.

A fitted step model gives the typical step; the real engine's steps scatter around it (the
API process's work landing on the same cores, the allocator, the OS), and those strays are
what a p99 inter-token gap is made of, and what a queue multiplies into a p99 TTFT. A serving
calibration (`quill cost calibrate --from-steps`, steps the server recorded under load) holds
the scatter of a serving engine. Each replica draws from its own seeded generator, so a run
is repeatable. The draws are independent: a slow patch lasting several steps is not modeled.
Where the calibration measured each kind of step (decode, prefill, mixed) apart, a step draws
from its kind's ratios: their medians carry what the one step model leaves of each kind's bias.
"""

from __future__ import annotations

import random


class StepJitter:
    """Draws a step-time ratio from percentiles 0..100 (linear between them)."""

    def __init__(self, percentiles: list[float], seed: str | int) -> None:
        if len(percentiles) != 101 or any(b < a for a, b in zip(percentiles, percentiles[1:])):
            raise ValueError("step-time ratios: 101 ascending percentiles expected")
        self.percentiles = percentiles
        self._random = random.Random(seed).random

    def draw(self) -> float:
        u = self._random() * 100.0
        i = int(u)
        if i >= 100:
            return self.percentiles[100]
        low = self.percentiles[i]
        return low + (self.percentiles[i + 1] - low) * (u - i)


def kind_of(shape) -> str:
    """A step's kind as the calibration counts it: decode (every token a decode), prefill
    (none), mixed."""
    if not shape.num_prefill_tokens:
        return "decode"
    return "mixed" if shape.num_decode_tokens else "prefill"


class StepJitters:
    """A replica's draws: from its kind's ratios where measured, else from all steps'."""

    def __init__(
        self, overall: tuple | None, by_kind: dict[str, tuple] | None, seed: str | int
    ) -> None:
        self.overall = None if overall is None else StepJitter(list(overall), seed)
        self.by_kind = {
            kind: StepJitter(list(ratios), f"{seed}:{kind}")
            for kind, ratios in (by_kind or {}).items()
        }

    def for_kind(self, kind: str) -> StepJitter | None:
        return self.by_kind.get(kind, self.overall)
