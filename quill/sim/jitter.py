"""Step-to-step jitter: a simulated step takes its price times a ratio drawn from the ratios
the calibration measured (measured / predicted over the steps it was fitted on), so that the
simulator's inter-token gaps and queues have the spread a real engine's have, not only their
typical size.

A fitted step model gives the typical step; the real engine's steps scatter around it (the
API process's work landing on the same cores, the allocator, the OS), and those strays are
what a p99 inter-token gap is made of, and what a queue multiplies into a p99 TTFT. A serving
calibration (`quill cost calibrate --from-steps`, steps the server recorded under load) holds
the scatter of a serving engine. Each replica draws from its own seeded generator, so a run
is repeatable. Where the calibration measured each kind of step (decode, prefill, mixed)
apart and the simulation asks for it (`--step-jitter-by-kind`), a step draws from its kind's
ratios: their medians carry what the one step model leaves of each kind's bias.

Where it measured how long a stray lasts (`step_time_memory`, quill/cost/refit.py), the draws
remember: each step's quantile comes from a normal score whose `shared` part is a level
wandering with a time constant of `seconds` (an Ornstein-Uhlenbeck process in virtual time),
the rest the step's own. Each kind's ratios keep their measured spread (the score is standard
normal at every step), but slow steps come in patches, as on the server, and a patch stretches
a whole reply where independent draws would average out over its steps.
"""

from __future__ import annotations

import math
import random


class StepJitter:
    """Draws a step-time ratio from percentiles 0..100 (linear between them)."""

    def __init__(self, percentiles: list[float], seed: str | int) -> None:
        if len(percentiles) != 101 or any(b < a for a, b in zip(percentiles, percentiles[1:])):
            raise ValueError("step-time ratios: 101 ascending percentiles expected")
        self.percentiles = percentiles
        self._random = random.Random(seed).random

    def draw(self) -> float:
        return self.at(self._random())

    def at(self, quantile: float) -> float:
        """The ratio at `quantile` in [0, 1)."""
        u = quantile * 100.0
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
    """A replica's draws: from its kind's ratios where measured, else from all steps'.
    `memory`: (shared, seconds) of the strays' level (module docstring); None: independent."""

    def __init__(
        self,
        overall: tuple | None,
        by_kind: dict[str, tuple] | None,
        seed: str | int,
        memory: tuple[float, float] | None = None,
    ) -> None:
        self.overall = None if overall is None else StepJitter(list(overall), seed)
        self.by_kind = {
            kind: StepJitter(list(ratios), f"{seed}:{kind}")
            for kind, ratios in (by_kind or {}).items()
        }
        self.memory = memory
        if memory is not None:
            shared, seconds = memory
            if not 0 <= shared <= 1 or seconds <= 0:
                raise ValueError(f"step-time memory: shared in [0, 1], seconds > 0; got {memory}")
            self._gauss = random.Random(f"{seed}:memory").gauss
            self._shared = math.sqrt(shared)
            self._own = math.sqrt(1.0 - shared)
            self._tau = seconds
            self._level = self._gauss(0.0, 1.0)  # the wandering level, standard normal
            self._at = None  # virtual time of the level's last draw

    def draw(self, kind: str, now: float) -> float:
        """The ratio for a step of `kind` starting at virtual time `now` (1.0: none measured)."""
        draws = self.by_kind.get(kind, self.overall)
        if draws is None:
            return 1.0
        if self.memory is None:
            return draws.draw()
        gauss = self._gauss
        if self._at is None:
            self._at = now
        elif now > self._at:
            keep = math.exp((self._at - now) / self._tau)
            self._level = keep * self._level + math.sqrt(1.0 - keep * keep) * gauss(0.0, 1.0)
            self._at = now
        score = self._shared * self._level + self._own * gauss(0.0, 1.0)
        return draws.at(0.5 * (1.0 + math.erf(score / math.sqrt(2.0))))
