"""Speculative decoding in virtual time: drafts, and their fate, drawn from measured chances.

A simulated reply's token ids carry no text, so the n-gram lookup would find drafts, or miss
them, by accident. Here a decode that the scheduler asks for drafts gets some with the measured
chance that the proposer found any (`proposal_rate`), as many as a proposal measured on
average (at most those allowed), and each holds with the chance that a draft held when the ones
before it did (`acceptance`). Everything else is the engine's own: the scheduler books the
drafts' slots, the switch (quill/engine/spec_switch.py) turns drafts on and off by the cost
model, the pass is priced with its 1 + d tokens a sequence, the rejected drafts' blocks go
back, and the counters are the engine's counters.

The chances come from a real server's counters over a workload (`SpecChances.measured`): a
real reply's acceptance depends on its text (a reply quoting its prompt accepts most drafts;
free prose, few), which only a run of the real model on that text can tell.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class SpecChances:
    proposal_rate: float = 1.0  # of the decodes asked for drafts, the share that got some
    mean_length: float | None = None  # drafts a proposal holds (None: all allowed)
    acceptance: float = 0.0  # P(a draft holds | the drafts before it held)

    def __post_init__(self) -> None:
        for name in ("proposal_rate", "acceptance"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"speculation's {name} must be within [0, 1], got {value}")
        if self.mean_length is not None and self.mean_length < 0:
            raise ValueError(f"speculation's mean_length must be >= 0, got {self.mean_length}")

    @classmethod
    def measured(
        cls,
        num_drafts: float,
        num_draft_tokens: float,
        num_accepted_tokens: float,
        num_eligible: float | None = None,
        num_proposed: float | None = None,
    ) -> SpecChances:
        """From a server's spec_decode counters over a run: `num_drafts` verifications of
        `num_draft_tokens` drafts, `num_accepted_tokens` of them accepted; of `num_eligible`
        decodes asked for drafts, `num_proposed` got some. The acceptance is the one that
        keeps, with proposals of the measured mean length, the measured accepted drafts per
        verification (what sets the tokens a pass yields)."""
        if num_drafts <= 0:
            return cls(proposal_rate=0.0, mean_length=0.0, acceptance=0.0)
        length = num_draft_tokens / num_drafts
        rate = 1.0 if not num_eligible else min(1.0, (num_proposed or 0) / num_eligible)
        target = num_accepted_tokens / num_drafts
        return cls(rate, length, _acceptance_for(target, length))


def expected_accepted(acceptance: float, length: float) -> float:
    """Accepted drafts per verification: sum of a^i over a proposal's drafts, with proposals of
    floor(length) or ceil(length) drafts in the mix that averages `length`."""
    low = math.floor(length)
    frac = length - low

    def run(n: int) -> float:
        return sum(acceptance**i for i in range(1, n + 1))

    return (1 - frac) * run(low) + frac * run(low + 1)


def _acceptance_for(target: float, length: float) -> float:
    """The acceptance whose expected accepted drafts per verification is `target`."""
    if target <= 0 or length <= 0:
        return 0.0
    if target >= length:
        return 1.0
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if expected_accepted(mid, length) < target:
            low = mid
        else:
            high = mid
    return (low + high) / 2


class SimDrafts:
    """A replica's drafts and verdicts, from its own seeded generator (a run repeats)."""

    def __init__(self, chances: SpecChances, seed: str, token: int) -> None:
        self.chances = chances
        self.token = token
        self._random = random.Random(seed).random

    def propose(self, request, k: int) -> list[int]:
        """The scheduler's proposer (Scheduler.proposer): up to `k` drafts, or none."""
        c = self.chances
        if self._random() >= c.proposal_rate:
            return []
        n = k
        if c.mean_length is not None:
            whole = math.floor(c.mean_length)
            n = min(k, whole + (self._random() < c.mean_length - whole))
        return [self.token] * n

    def verify(self, num_drafts: int) -> int:
        """How many of a sequence's `num_drafts` drafts hold (a run from the first)."""
        accepted = 0
        a = self.chances.acceptance
        while accepted < num_drafts and self._random() < a:
            accepted += 1
        return accepted
