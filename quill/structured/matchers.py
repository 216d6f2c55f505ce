"""The engine's side of structured output: a matcher per constrained request, made off the
engine loop under a deadline, its mask in every step that samples the request, and each
token it samples taken in after. Torch-free, like the engine core that holds it.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.structured.grammar import GrammarError, Grammars, Matcher

# The most one token's mask may cost: masks are computed on the engine thread, so a grammar
# whose parse grows with the reply (an ambiguous Lark grammar can reach a third of a second a
# token within 200 tokens) would slow every neighbour's step. Typical masks cost 0.1 ms.
MASK_BUDGET_S = 0.025


class ReplyMatchers:
    def __init__(
        self,
        grammars: Grammars,
        compile_timeout_s: float = 10.0,
        mask_budget_s: float = MASK_BUDGET_S,
    ) -> None:
        self.grammars = grammars
        self.compile_timeout_s = compile_timeout_s
        self.mask_budget_s = mask_budget_s
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="quill-grammar")
        self._making: dict[str, tuple[Future, float]] = {}  # request id -> (future, deadline)
        # request id -> [matcher, tokens taken, seconds its last mask took]
        self._matchers: dict[str, list] = {}
        self.num_refused = 0
        self.num_over_budget = 0
        self.num_compiled = 0
        self.compile_seconds = 0.0
        self.num_masks = 0
        self.mask_seconds = 0.0

    def check(self, constraint: Constraint) -> None:
        """Refuse a constraint the library cannot enforce (the grammar is cached after)."""
        try:
            self.grammars.compile(constraint)
        except GrammarError as e:
            self.num_refused += 1
            raise InvalidRequestError(f"{constraint.kind}: {e}", param="structured") from e

    def start(self, request_id: str, constraint: Constraint, now: float) -> None:
        future = self._pool.submit(self._make, constraint)
        self._making[request_id] = (future, now + self.compile_timeout_s)

    def _make(self, constraint: Constraint) -> Matcher:
        started = time.perf_counter()
        matcher = self.grammars.matcher(constraint)
        self.compile_seconds += time.perf_counter() - started
        self.num_compiled += 1
        return matcher

    @property
    def num_making(self) -> int:
        return len(self._making)

    def ready(self, now: float) -> tuple[list[str], dict[str, str]]:
        """Requests whose matcher is made (ready to schedule), and those that failed, why."""
        done, failed = [], {}
        for request_id, (future, deadline) in list(self._making.items()):
            if future.done():
                del self._making[request_id]
                try:
                    self._matchers[request_id] = [future.result(), 0, 0.0]
                    done.append(request_id)
                except GrammarError as e:
                    failed[request_id] = f"structured output: {e}"
            elif now > deadline:
                del self._making[request_id]
                future.cancel()
                failed[request_id] = (
                    f"structured output: the grammar did not compile within "
                    f"{self.compile_timeout_s:g} s"
                )
        return done, failed

    def wait(self, timeout_s: float) -> None:
        """Block until a matcher is made or `timeout_s` passes (nothing else to run)."""
        futures = [f for f, _ in self._making.values()]
        if futures:
            wait(futures, timeout_s, return_when="FIRST_COMPLETED")

    def bitmask(self, request_id: str) -> bytes | None:
        entry = self._matchers.get(request_id)
        if entry is None:
            return None
        started = time.perf_counter()
        mask = entry[0].bitmask()
        entry[2] = time.perf_counter() - started
        self.mask_seconds += entry[2]
        self.num_masks += 1
        return mask

    def take(self, request_id: str, output_token_ids: list[int]) -> str | None:
        """Take the reply's tokens not yet taken; why the grammar refused one (or its last
        mask cost more than the budget), or None."""
        entry = self._matchers.get(request_id)
        if entry is None:
            return None
        matcher, taken, mask_seconds = entry
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
        making = self._making.pop(request_id, None)
        if making is not None:
            making[0].cancel()
