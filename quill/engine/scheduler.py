"""The scheduler: decides how many tokens each request computes in the next step. No torch.

Every step is one pass over the model under a token budget. Running requests go first (a decode
costs one token), then waiting prompts fill what is left in chunks, so a long prompt never holds
the running streams for more than one budget's worth of work. With speculative decoding on, a
decoding request may carry drafts (quill/engine/speculative.py) that the same pass verifies;
their KV slots are booked for the step, and those of rejected drafts are given back after it;
blocks are entered in the prefix cache only once verified. A request admitted with a cached
prefix starts past it. When the KV pool runs dry the last request of the running list (the
policy orders it, see `request_queue`) is preempted: its blocks are freed, their cached content
stays, and it is recomputed later from whatever of it is still cached.

A request whose prompt's KV a prefill instance computed gets its blocks when admitted and then
waits aside (FETCHING) while the executor fetches the KV beside the steps; it joins the
running requests once the KV is in (`fetched`). Its blocks are never freed while a fetch may
still write into them: a request ended meanwhile keeps them until its fetch ends.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from quill.config import SchedulingPolicy, SpeculativeConfig
from quill.contract.errors import InvalidRequestError
from quill.contract.messages import SpecDecodeStats
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request, RequestStatus
from quill.engine.request_queue import DEFAULT_PRIORITY_AGING, add_running, make_waiting_queue
from quill.engine.spec_switch import SpeculationSwitch
from quill.engine.speculative import propose_ngram


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    num_tokens: int  # tokens computed for this request in this step
    start: int  # position of the first of them (num_computed_tokens before the step)
    # The step reaches the request's last token, so a new token is sampled (unless it asked
    # for none: max_tokens 0). Fixed when the request is scheduled: its token count changes
    # only in `update`, after this is read.
    samples: bool
    # Guessed tokens after the request's last one, verified in this step (then `num_tokens`
    # is 1 + their count); None: none.
    draft_token_ids: list[int] | None = None

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        last = start + num_tokens == request.num_tokens
        return cls(request, num_tokens, start, last and request.max_tokens > 0)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)  # finished while scheduling
    fetches: list[Request] = field(default_factory=list)  # their KV fetches start now

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.fetches


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching, FCFS or priority admission
    and recompute preemption."""

    def __init__(
        self,
        kv: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        priority_aging: float = DEFAULT_PRIORITY_AGING,
        speculative: SpeculativeConfig | None = None,
        spec_switch: SpeculationSwitch | None = None,
    ) -> None:
        """`speculative`: propose drafts for decodes (`spec_switch`: how many, per step; None:
        always num_speculative_tokens)."""
        self.kv = kv
        self.token_budget = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = make_waiting_queue(policy, priority_aging)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.fetching: dict[str, Request] = {}  # KV on the way (each one's fetch started)
        self.abandoned_fetches: set[str] = set()  # ended meanwhile: blocks held until it ends
        self.num_preemptions = 0
        self.num_transferred_prompt_tokens = 0  # see KVTransferStats
        self.speculative = speculative
        self.spec_switch = spec_switch
        # What guesses a decoding request's next tokens, (request, at most k) -> drafts: None
        # for the n-gram lookup; the simulator puts its measured chances in its place.
        self.proposer: Callable[[Request, int], list[int]] | None = None
        k = speculative.num_speculative_tokens if speculative is not None else 0
        self.spec_stats = SpecDecodeStats(accepted_per_position=[0] * k)
        # An encoder's (no causal attention): each prompt is computed whole, in one step, and
        # only pooled (set by the engine worker).
        self.whole_prompts = False

    # -- requests in and out -------------------------------------------------------------
    def check_request(self, request: Request) -> None:
        """Raise InvalidRequestError if the request can never be served here."""
        if self.whole_prompts:
            if request.sampling_params.pooling is None:
                raise InvalidRequestError(
                    "this model is an encoder: it computes embeddings (/v1/embeddings), it "
                    "does not generate",
                    param="model",
                )
            if request.num_prompt_tokens > self.token_budget:
                raise InvalidRequestError(
                    f"prompt of {request.num_prompt_tokens} tokens is longer than the step's "
                    f"token budget ({self.token_budget}, --max-num-batched-tokens): an encoder "
                    "takes each prompt in one pass",
                    param="prompt",
                )
        num_tokens = request.num_prompt_tokens + 1
        needed = self.kv.peak_blocks(num_tokens, min(num_tokens, self.token_budget))
        if needed > self.kv.num_blocks:
            raise InvalidRequestError(
                f"prompt of {request.num_prompt_tokens} tokens can never fit in the KV cache "
                f"({self.kv.num_blocks} blocks of {self.kv.block_size} tokens, {needed} needed)",
                param="prompt",
            )
        if request.remote_kv is not None and self.kv.num_groups > 1:
            raise InvalidRequestError(
                "prompt KV from a prefill instance cannot be taken by a model with "
                f"{self.kv.num_groups} KV groups (sliding-window layers beside global ones)",
                param="kv_transfer_params",
            )
        if request.prompt_logprobs is not None and request.remote_kv is not None:
            raise InvalidRequestError(
                "prompt logprobs need the prompt computed here, not its KV taken from a "
                "prefill instance",
                param="prompt_logprobs",
            )
        if request.kv_lease_s is not None and request.max_tokens == 0:
            raise InvalidRequestError(
                "a prefill instance's request must sample its first token (max_tokens 0)",
                param="max_tokens",
            )
        if request.priority != 0 and self.policy != SchedulingPolicy.PRIORITY:
            raise InvalidRequestError(
                f"priority {request.priority} needs the priority scheduling policy "
                "(--scheduling-policy priority)",
                param="priority",
            )

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self.check_request(request)
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_request(
        self, request_id: str, reason: str, stop_reason=None, now: float = 0.0
    ) -> Request | None:
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status == RequestStatus.FETCHING:
            del self.fetching[request_id]
            self.abandoned_fetches.add(request_id)  # the fetch may still write its blocks
            request.status = RequestStatus.FINISHED
            request.finish_reason = reason
            request.stop_reason = stop_reason
            return request
        else:
            self.waiting.remove(request)
        # Leased only when capped by its length (a prefill instance's max_tokens): one that
        # stopped is answered whole.
        if request.kv_lease_s is not None and reason == "length":
            expires = now + request.kv_lease_s
            request.kv_lease = self.kv.lease(request_id, request.num_computed_tokens, expires)
        else:
            self.kv.free(request_id, uncache=reason == "error")
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        return request

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """Requests to serve, or fetches still to hear the end of."""
        return bool(self.requests) or bool(self.abandoned_fetches)

    @property
    def num_fetching(self) -> int:
        """Fetches in flight: those of live requests and of requests ended meanwhile."""
        return len(self.fetching) + len(self.abandoned_fetches)

    # -- one step ------------------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        running = self.running
        scheduled = out.scheduled
        # This loop runs once per running request per step (millions of times in a simulation),
        # so it reads the request's lists directly rather than through its properties.
        kv = self.kv
        tables = kv.block_tables
        block_size = kv.block_size
        caching = kv.enable_prefix_caching
        max_drafts = 0 if self.speculative is None else None  # None: decided at first decode
        i = 0
        while i < len(running) and budget > 0:
            request = running[i]
            start = request.num_computed_tokens
            total = len(request.prompt_token_ids) + len(request.output_token_ids)
            n = total - start
            if n == 1 and max_drafts != 0 and budget > 1:
                if max_drafts is None:
                    max_drafts = self._drafts_this_step(start)
                drafts = self._propose(request, total, min(max_drafts, budget - 1))
                if drafts and kv.allocate_slots(request, total + len(drafts)):
                    if caching:  # the blocks full of verified tokens (several filled lately)
                        kv.cache_blocks(request, total)
                    scheduled.append(ScheduledRequest(request, 1 + len(drafts), start, True,
                                                      drafts))  # fmt: skip
                    budget -= 1 + len(drafts)
                    i += 1
                    continue
            if n > budget:
                n = budget
            table = tables.get(request.request_id)
            # Blocks to spare (the common case for a decode) need no allocation.
            if table is None or len(table[0]) * block_size < start + n:
                n = self._grow_or_preempt(request, n, out)
                if not n:
                    continue  # request was preempted or finished; running[i] is the next one
            if caching and (start + n) % block_size < n:  # a block fills up in this step
                kv.cache_blocks(request, start + n)
            samples = start + n == total and request.max_tokens > 0
            scheduled.append(ScheduledRequest(request, n, start, samples))
            budget -= n
            i += 1

        # Admitting new work right after preempting would only thrash the pool.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) + len(self.fetching) < self.max_num_seqs
        ):
            request = self.waiting.peek()
            # Nothing is computed yet (preempted requests too), unless the request's KV comes
            # from elsewhere (a prefill instance or replica).
            computed = request.num_computed_tokens
            remote = request.remote_kv
            cached = kv.find_cached_prefix(request)
            num_cached = len(cached[0]) * block_size
            if remote is not None:  # its KV comes from a prefill instance but what is cached
                request.remote_kv = replace(remote, num_cached_blocks=len(cached[0]))
            else:
                computed += num_cached
            n = min(request.num_tokens - computed, budget)
            if self.whole_prompts and n < request.num_tokens - computed:
                break  # the next step takes it whole
            if not kv.allocate_slots(request, computed + n, cached):
                if self.running or self.fetching or remote is not None:
                    break  # blocks come back as they finish (a fetch needs its whole prompt's)
                # Nothing else holds blocks to wait for: a smaller chunk (a sliding window's
                # table holds the window and the chunk), or it would wait forever.
                n = min(n, kv.reach(request, cached) - computed)
                if n < 1 or not kv.allocate_slots(request, computed + n, cached):
                    break
            self.waiting.pop()
            request.num_computed_tokens = computed
            if remote is not None:  # waits aside for its KV: no token of this step's budget
                request.status = RequestStatus.FETCHING
                self.fetching[request.request_id] = request
                out.fetches.append(request)
                if caching:
                    kv.record_lookup(request.num_tokens, num_cached)
                kv.cache_blocks(request, num_cached)
                if request.times.first_scheduled is None:
                    request.times.first_scheduled = now
                    request.num_cached_tokens = num_cached
                continue
            add_running(self.running, request, self.policy)
            request.status = RequestStatus.RUNNING
            if request.kv_transferred:  # what of its prompt is computed here after all
                self.num_transferred_prompt_tokens += max(
                    0, len(request.prompt_token_ids) - computed
                )
            if caching and computed == num_cached:
                kv.record_lookup(request.num_tokens, num_cached)
            if request.times.first_scheduled is None:
                request.times.first_scheduled = now
                request.num_cached_tokens = num_cached
            kv.cache_blocks(request, computed + n)
            scheduled.append(ScheduledRequest.of(request, n))
            budget -= n
        return out

    def _drafts_this_step(self, context: int) -> int:
        if self.spec_switch is None:
            allowed = self.speculative.num_speculative_tokens
        else:
            allowed = self.spec_switch.num_drafts(len(self.running), context)
        self.spec_stats.drafts_allowed = allowed
        return allowed

    def _propose(self, request: Request, total: int, k: int) -> list[int]:
        """Drafts for a decoding request, at most `k`, none where they could not stay exact
        or would run past its limits: penalties, structured output and a thinking budget
        depend on each token before (not modelled for drafts yet); min_tokens would bar end
        ids at some drafted positions only."""
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        k = min(k, request.max_tokens - num_output - 1, self.max_model_len - total - 1)
        if (
            k < 1
            or params.uses_penalties
            or params.structured is not None
            or params.thinking_budget is not None
            or num_output < params.min_tokens
        ):
            return []
        drafts = (self.proposer or self._propose_ngram)(request, k)
        self.spec_stats.num_eligible += 1
        self.spec_stats.num_proposed += bool(drafts)
        if self.spec_switch is not None:
            self.spec_switch.on_proposals(1, bool(drafts))
        return drafts

    def _propose_ngram(self, request: Request, k: int) -> list[int]:
        spec = self.speculative
        tokens = request.prompt_token_ids + request.output_token_ids
        return propose_ngram(tokens, k, spec.prompt_lookup_min, spec.prompt_lookup_max)

    def _grow_or_preempt(self, request: Request, n: int, out: SchedulerOutput) -> int:
        """Blocks for the request's next `n` tokens, preempting the latest requests for them;
        how many tokens it computes this step (0: it was preempted or finished)."""
        computed = request.num_computed_tokens
        while not self.kv.allocate_slots(request, computed + n):
            if len(self.running) == 1:
                # Alone: the chunk the pool can hold (a sliding window's table holds the
                # window and the chunk), or the pool cannot hold this sequence any longer.
                fit = min(n, self.kv.reach(request) - computed)
                if fit >= 1 and self.kv.allocate_slots(request, computed + fit):
                    return fit
                self.finish_request(request.request_id, "length")
                out.finished.append(request)
                return 0
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return 0
        return n

    def fetched(self, request_id: str) -> Request | None:
        """A fetch ended with the KV in: its request runs from the next step (and others may
        map its prompt's blocks from the prefix cache); None if it had ended meanwhile (its
        blocks are freed now)."""
        if request_id in self.abandoned_fetches:
            self.abandoned_fetches.discard(request_id)
            self.kv.free(request_id)
            return None
        request = self.fetching.pop(request_id)
        request.status = RequestStatus.RUNNING
        add_running(self.running, request, self.policy)
        self.kv.cache_blocks(request, len(request.prompt_token_ids))
        return request

    def fetch_failed(self, request_id: str) -> Request | None:
        """A fetch ended without the KV: its request (None if it had ended meanwhile: its
        blocks are freed now), still FETCHING, for `recompute` or `finish_request`."""
        if request_id in self.abandoned_fetches:
            self.abandoned_fetches.discard(request_id)
            self.kv.free(request_id, uncache=True)
            return None
        request = self.fetching.pop(request_id)
        request.status = RequestStatus.RUNNING  # as if it had run: either call takes it so
        self.running.append(request)
        return request

    def recompute(self, request_id: str) -> None:
        """Compute a running request's KV here after all (its fetch from a prefill instance
        failed): back to the queue's front with nothing computed, its blocks forgotten."""
        request = self.requests[request_id]
        self.running.remove(request)
        self.kv.free(request_id, uncache=True)
        request.num_computed_tokens = 0
        request.remote_kv = None
        request.status = RequestStatus.PREEMPTED
        self.waiting.push_preempted(request)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_preempted(request)

    def update(
        self, out: SchedulerOutput, sampled: dict[str, list[int]], now: float = 0.0
    ) -> tuple[list[Request], list[Request]]:
        """Apply a step's results: each sampling request's tokens in order, up to the first
        that ends it (the rest are dropped). Returns (requests that got tokens, requests that
        finished)."""
        advanced: list[Request] = []
        finished: list[Request] = list(out.finished)
        running = RequestStatus.RUNNING
        spec = self.spec_stats
        max_len = self.max_model_len
        for s in out.scheduled:
            request = s.request
            if request.status is not running:  # aborted, or sent back to recompute
                continue
            tokens = sampled[request.request_id] if s.samples else ()
            drafts = s.draft_token_ids
            if drafts:
                # The last token and the accepted drafts are computed; the slots past them
                # held rejected drafts: their blocks go back (never cached: see schedule).
                accepted = len(tokens) - 1
                request.num_computed_tokens += 1 + accepted
                spec.on_verified(len(drafts), accepted)
                request.num_draft_tokens += len(drafts)
                request.num_accepted_tokens += accepted
                if self.spec_switch is not None:
                    self.spec_switch.on_verified(len(drafts), accepted)
                if accepted < len(drafts):
                    self.kv.trim(request.request_id, request.num_computed_tokens + 1)
            else:
                request.num_computed_tokens += s.num_tokens
            if not s.samples:
                if request.max_tokens == 0 and request.num_computed_tokens >= len(
                    request.prompt_token_ids
                ):  # it asked for its prompt computed (scored), and no token
                    self.finish_request(request.request_id, "length", None, now)
                    finished.append(request)
                continue
            advanced.append(request)
            output = request.output_token_ids
            params = request.sampling_params
            for token in tokens:
                output.append(token)
                request.times.on_token(now)
                num_output = len(output)
                if (  # nothing ends it (_check_stop's tests, inline: once a token)
                    num_output < request.max_tokens
                    and len(request.prompt_token_ids) + num_output < max_len
                    and (
                        num_output < params.min_tokens
                        or (
                            (params.ignore_eos or token not in request.eos_token_ids)
                            and token not in params.stop_token_ids
                        )
                    )
                ):
                    continue
                reason, stop_reason = self._check_stop(request, token)
                if reason is not None:
                    self.finish_request(request.request_id, reason, stop_reason, now)
                    finished.append(request)
                    break
        return advanced, finished

    def _check_stop(self, request: Request, token: int) -> tuple[str | None, int | None]:
        params = request.sampling_params
        num_output = len(request.output_token_ids)
        if num_output >= params.min_tokens:
            if not params.ignore_eos and token in request.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
        if num_output >= request.max_tokens:
            return "length", None
        if len(request.prompt_token_ids) + num_output >= self.max_model_len:
            return "length", None
        return None, None
