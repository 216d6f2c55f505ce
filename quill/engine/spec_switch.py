"""Speculation on or off, step by step, by what the cost model says a pass costs. No torch.

A decode pass with drafts computes 1 + d tokens a sequence for an expected 1 + E(d) tokens out,
where E(d) is the expected length of the accepted run. It pays while the pass is movement-bound
(the weights' read dominates: 1 + d tokens cost about what one does) and loses once the batch
makes it arithmetic-bound. Each step the switch prices the running decodes with 0 .. k drafts
and picks the number that yields the most tokens a second, if that beats no drafts by a margin.

Prices come from a `StepTimer` (the cost model's price fitted to the measured steps, or a line
in token counts without a hardware spec), corrected by how far the measured pure-decode steps
with and without drafts fall from it (a pass of several queries a sequence may take another
kernel path than a one-query decode). Acceptance is measured as it runs, as one chance that a
draft holds given the ones before it did (the share of drafts tested that held: a draft after
a rejected one is never tested), so a run of d is expected to keep a + a^2 + ... + a^d of them
even for a d never tried; and the share of decodes for which the proposer found anything. While
off it still tries one step now and then, if perfect acceptance would pay, so that its measure
of acceptance cannot go stale for good.
"""

from __future__ import annotations

import math

from quill.cost.batch import BatchShape
from quill.engine.admission import StepTimer

PRIOR_ACCEPTANCE = 0.6  # first guess of P(a draft holds | the ones before it did)
PRIOR_WEIGHT = 2.0  # how many drafts' worth the first guess counts for
MARGIN = 0.03  # drafts must promise at least this much more tokens a second
PROBE_INTERVAL = 200  # steps off between tries (a try at a large batch costs about a step)
DECAY = 0.98  # per step, for the counts of drafts, acceptances and proposals


class SpeculationSwitch:
    """Chooses each step's number of drafts a decoding request may carry (0: none)."""

    def __init__(self, num_speculative_tokens: int, timer: StepTimer) -> None:
        k = num_speculative_tokens
        self.k = k
        self.timer = timer
        # Decayed counts of drafts tested (up to and including the first rejected one) and of
        # those that held, started from the prior.
        self.tested = PRIOR_WEIGHT
        self.held = PRIOR_WEIGHT * PRIOR_ACCEPTANCE
        self.proposals = PRIOR_WEIGHT  # decodes the proposer found drafts for
        self.eligible = PRIOR_WEIGHT  # decodes it was asked about
        # Measured / timer seconds of pure-decode steps, without drafts and with.
        self.excess = [1.0, 1.0]
        self.steps_off = 0

    # -- what has been measured --------------------------------------------------------------
    @property
    def draft_acceptance(self) -> float:
        """P(a draft holds | the drafts before it did), as measured."""
        return self.held / self.tested if self.tested else 0.0

    def acceptance(self) -> list[float]:
        """Per draft position i: P(drafts 0 .. i all hold)."""
        a = self.draft_acceptance
        return [a ** (i + 1) for i in range(self.k)]

    def expected_accepted(self, num_drafts: int) -> float:
        """Expected accepted drafts of a request given `num_drafts` of them."""
        return sum(self.acceptance()[:num_drafts])

    def on_proposals(self, num_eligible: int, num_proposed: int) -> None:
        self.eligible += num_eligible
        self.proposals += num_proposed

    def on_verified(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verification: `num_accepted` of its `num_drafts` drafts held."""
        self.tested += min(num_accepted + 1, num_drafts)
        self.held += num_accepted

    def on_step(self, plan, start: float, end: float) -> None:
        """A step listener: the timer's fit, the correction of pure-decode steps, the decay."""
        timer = self.timer
        timer.on_step(plan, start, end)
        shape = BatchShape.from_plan(plan)
        if shape.num_prefill_tokens == 0 and shape.num_tokens:
            predicted = timer.seconds(shape)
            if predicted > 0:
                kind = 1 if plan.num_draft_tokens else 0
                self.excess[kind] += 0.2 * ((end - start) / predicted - self.excess[kind])
        self.tested *= DECAY
        self.held *= DECAY
        self.eligible *= DECAY
        self.proposals *= DECAY

    # -- the decision ------------------------------------------------------------------------
    def num_drafts(self, num_decodes: int, context: int) -> int:
        """Drafts each of `num_decodes` decoding requests (at about `context` tokens) may carry
        in this step: the number with the most expected tokens a second, 0 if none beats no
        drafts by MARGIN (now and then k while off, to measure acceptance again)."""
        best = self._best(num_decodes, context, self.acceptance())
        if best == 0:
            self.steps_off += 1
            perfect = [1.0] * self.k
            if self.steps_off >= PROBE_INTERVAL and self._best(num_decodes, context, perfect):
                best = self.k
        if best:
            self.steps_off = 0
        return best

    def _best(self, b: int, context: int, rates: list[float]) -> int:
        share = self.proposals / self.eligible if self.eligible else 0.0
        expected = b * share  # decodes expected to get drafts (those without cost nothing)
        if expected <= 0:
            return 0
        # The step's price between those of floor(expected) and ceil(expected) drafting
        # requests (at one decode: drafts this step with chance `share`, else none).
        low = math.floor(expected)
        high_weight = expected - low
        plain = self.timer.seconds(_decodes(b, 0, context, 0)) * self.excess[0]
        best, best_rate = 0, b / plain * (1 + MARGIN) if plain > 0 else 0.0
        gained = 0.0
        for d in range(1, self.k + 1):
            gained += rates[d - 1]
            seconds = (1 - high_weight) * self._seconds(b, low, context, d, plain)
            if high_weight:
                seconds += high_weight * self._seconds(b, low + 1, context, d, plain)
            rate = (b + expected * gained) / seconds if seconds > 0 else 0.0
            if rate > best_rate:
                best, best_rate = d, rate
        return best

    def _seconds(self, b: int, bp: int, context: int, d: int, plain: float) -> float:
        if bp == 0:
            return plain
        return self.timer.seconds(_decodes(b, bp, context, d)) * self.excess[1]


def _decodes(b: int, bp: int, context: int, d: int) -> BatchShape:
    """`b` decodes after `context` tokens, `bp` of them with `d` drafts each, in O(1)."""
    n = 1 + d
    tokens = b + bp * d
    plain = b - bp
    pairs = plain * (context + 1) + bp * (n * context + n * (n + 1) // 2)
    read = plain * (context + 1) + bp * (context + n)
    return BatchShape(tokens, b, tokens, 0, tokens, pairs, read, tokens)
