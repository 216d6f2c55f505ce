"""The engine's side of structured output: a matcher per constrained request, prepared before
the request is admitted, its mask in every step that samples the request, and each token it
samples taken in after. Torch-free, like the engine core that holds it.

Preparing a request (`prepare`) happens on a deep-stack grammar thread (quill/structured/
threads.py), off the engine loop and off the thread that receives requests: the grammar is
compiled (cached), the request's matcher made, and a copy of it walks `probe_tokens` tokens
through its masks (a seeded random path of allowed tokens), each mask timed. A grammar the
library refuses, or whose masks already cost more than the budget, is the client's error (an
InvalidRequestError, a 400) before the request is queued. A grammar whose masks grow past the
budget later, as the reply lengthens, ends that reply with the same kind of error.
"""

from __future__ import annotations

import random
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.structured.grammar import GrammarError, Grammars, Matcher
from quill.structured.threads import DeepStackThreads

# The most one token's mask may cost (CPU time of the thread computing it): masks are computed
# on the engine thread, so a grammar whose parse grows with the reply (an ambiguous Lark
# grammar can reach a third of a second a token within 200 tokens) would slow every
# neighbour's step. Typical masks cost 0.1 ms.
MASK_BUDGET_S = 0.025
# Tokens the preparation walks through a fresh matcher's masks before admitting its request.
PROBE_TOKENS = 16
PARAM = "structured"  # the field the engine names; the server names the request's own


@dataclass
class Prepared:
    """A constrained request's matcher, ready for its first step."""

    matcher: Matcher
    warnings: tuple[str, ...] = ()  # what of the constraint the grammar does not enforce


class ReplyMatchers:
    def __init__(
        self,
        grammars: Grammars,
        mask_budget_s: float = MASK_BUDGET_S,
        probe_tokens: int = PROBE_TOKENS,
        prepare_timeout_s: float = 10.0,
    ) -> None:
        self.grammars = grammars
        self.mask_budget_s = mask_budget_s
        self.probe_tokens = probe_tokens
        self.prepare_timeout_s = prepare_timeout_s
        self._threads = DeepStackThreads(2, "quill-grammar")
        # request id -> [matcher, tokens taken, seconds its last mask took, why it failed]
        self._matchers: dict[str, list] = {}
        self.num_refused = 0
        self.num_over_budget = 0
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self.num_masks = 0
        self.mask_seconds = 0.0

    # -- before admission (any thread) -------------------------------------------------------
    def prepare(self, constraint: Constraint) -> Future:
        """A future of the constraint's `Prepared` matcher; it raises InvalidRequestError
        when the grammar cannot be enforced or its first masks cost more than the budget."""
        return self._threads.submit(self._prepare, constraint)

    def prepare_now(self, constraint: Constraint) -> Prepared:
        """`prepare`, waited for (at most `prepare_timeout_s`)."""
        future = self.prepare(constraint)
        try:
            return future.result(self.prepare_timeout_s)
        except TimeoutError:
            future.cancel()
            raise self.timed_out() from None

    def timed_out(self) -> InvalidRequestError:
        self.num_refused += 1
        return InvalidRequestError(
            f"structured output: the grammar was not ready within {self.prepare_timeout_s:g} s",
            PARAM,
        )

    def _prepare(self, constraint: Constraint) -> Prepared:
        started = time.perf_counter()
        try:
            compiled = self.grammars.compile(constraint)
            matcher = Matcher(self.grammars.tokenizer, compiled.grammar)
            self.compile_seconds += time.perf_counter() - started
            self.num_compiled += 1
            slowest, at = self._probe(matcher.copy(), constraint)
        except GrammarError as e:
            self.num_refused += 1
            raise InvalidRequestError(f"{constraint.kind}: {e}", PARAM) from None
        if slowest > self.mask_budget_s:
            self.num_refused += 1
            raise InvalidRequestError(
                f"structured output: the grammar's token mask took {slowest * 1e3:.1f} ms at "
                f"token {at}, more than the {self.mask_budget_s * 1e3:g} ms a reply may add to "
                "every step (make the grammar less ambiguous or smaller)",
                PARAM,
            )
        return Prepared(matcher, compiled.warnings)

    def _probe(self, matcher: Matcher, constraint: Constraint) -> tuple[float, int]:
        """The slowest of the first masks along a seeded random path of allowed tokens, and
        the token it was at. Raises GrammarError if the matcher fails on the way."""
        rng = random.Random(zlib.crc32(constraint.value.encode()))
        ends = np.fromiter(self.grammars.end_token_ids, np.int64)
        vocab = self.grammars.vocab_size
        slowest, at = 0.0, 0
        for position in range(self.probe_tokens):
            started = time.thread_time()
            mask = matcher.bitmask()
            took = time.thread_time() - started
            if took > slowest:
                slowest, at = took, position
            if slowest > self.mask_budget_s or matcher.is_finished:
                break
            bits = np.unpackbits(np.frombuffer(mask, np.uint8), bitorder="little")[:vocab]
            choices = np.setdiff1d(np.flatnonzero(bits), ends, assume_unique=True)
            if not len(choices):
                break
            matcher.accept(int(choices[rng.randrange(len(choices))]))
        return slowest, at

    # -- the engine thread -------------------------------------------------------------------
    def attach(self, request_id: str, prepared: Prepared) -> None:
        """The request's matcher from now on (its request was admitted)."""
        self._matchers[request_id] = [prepared.matcher, 0, 0.0, None]

    def bitmask(self, request_id: str) -> bytes | None:
        entry = self._matchers.get(request_id)
        if entry is None:
            return None
        # The mask's own cost, in this thread's CPU time: on a shared machine the wall clock
        # also counts the moments the thread waits for a core (32.9 ms once, for a mask that
        # costs 0.1), which would end a good reply.
        started = time.thread_time()
        try:
            mask = entry[0].bitmask()
        except GrammarError as e:  # a parser limit passed: the reply ends after this step
            entry[3] = f"structured output: {e}"
            mask = self._ends_only()
        entry[2] = time.thread_time() - started
        self.mask_seconds += entry[2]
        self.num_masks += 1
        return mask

    def _ends_only(self) -> bytes:
        mask = bytearray((self.grammars.vocab_size + 7) // 8)
        for token in self.grammars.end_token_ids:
            mask[token // 8] |= 1 << (token % 8)
        return bytes(mask)

    def take(self, request_id: str, output_token_ids: list[int]) -> str | None:
        """Take the reply's tokens not yet taken; why the reply must end (the grammar refused
        a token or failed, or its last mask cost more than the budget), or None. Each is the
        request's own error (a 4xx), not the engine's."""
        entry = self._matchers.get(request_id)
        if entry is None:
            return None
        matcher, taken, mask_seconds, failed = entry
        if failed is not None:
            return failed
        if mask_seconds > self.mask_budget_s:
            self.num_over_budget += 1
            return (
                f"structured output: one token's mask took {mask_seconds * 1e3:.1f} ms, more "
                f"than the {self.mask_budget_s * 1e3:g} ms a reply may add to every step "
                "(the grammar's parse grows with the reply; make it less ambiguous)"
            )
        try:
            for token in output_token_ids[taken:]:
                matcher.accept(token)
        except GrammarError as e:
            return f"structured output: token refused by the grammar: {e}"
        finally:
            entry[1] = len(output_token_ids)
        return None

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def close(self) -> None:
        self._threads.close()
