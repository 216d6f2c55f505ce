"""A request as the scheduler sees it: token counts, KV blocks and timestamps. No torch."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from quill.contract.outputs import RequestMetrics
from quill.contract.pooling import PooledRows
from quill.contract.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FETCHING = "fetching"  # its prompt's KV is on the way from a prefill instance
    PREEMPTED = "preempted"
    FINISHED = "finished"


@dataclass
class RequestTimes:
    """Timestamps (clock seconds) and inter-token gaps of one request."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_itl: int = 0
    itl_sum: float = 0.0
    itl_max: float = 0.0
    # When set, every gap is also counted here (gap -> count), for exact percentiles over all
    # gaps; the simulator shares one map between its requests.
    itl_counts: dict[float, int] | None = None

    def on_token(self, now: float) -> None:
        # Runs once per generated token: no calls beyond what it must do.
        if self.first_token is None:
            self.first_token = now
        else:
            gap = now - self.last_token
            self.num_itl += 1
            self.itl_sum += gap
            if gap > self.itl_max:
                self.itl_max = gap
            counts = self.itl_counts
            if counts is not None:
                counts[gap] = counts.get(gap, 0) + 1
        self.last_token = now


@dataclass(eq=False)
class Request:
    """One sequence being served. `num_computed_tokens` counts tokens whose KV is cached.

    Equal only to itself: the scheduler removes requests from its lists, and a field-by-field
    comparison with each one before it (their token lists included) made taking the 200th of
    256 running requests out cost 0.17 ms."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    max_tokens: int  # resolved: never None, fits the model's context
    eos_token_ids: frozenset[int] = frozenset()  # every id that ends the reply (unless ignored)
    prompt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None  # why, when finish_reason is "error"
    # Set when the error is the request's own (its grammar failed): the field to blame, as
    # the 4xx it is; None: the engine's error (a 5xx).
    error_param: str | None = None
    times: RequestTimes = None  # type: ignore[assignment]
    priority: int = 0  # lower is served first (under the priority policy)
    cache_salt: str | None = None  # requests share cached blocks only with the same salt
    block_hashes: list[bytes | int] = field(default_factory=list)  # of its full blocks, so far
    num_cached_tokens: int | None = None  # prompt tokens found cached when first admitted
    ttft_slo: float | None = None  # seconds: refuse at once if the first token would be later
    predicted_ttft: float | None = None  # the admission check's prediction, in seconds
    # A prefill instance's request: when it ends (not in error, not aborted), its prompt's KV
    # blocks are kept this many seconds for a decode instance to fetch (kv_cache.KVLease).
    kv_lease_s: float | None = None
    kv_lease: object | None = None  # the KVLease it got, once finished
    # A decode instance's request whose prompt KV a prefill instance computed: fetched on its
    # first step (quill.contract.plan.RemoteKV), then None.
    remote_kv: object | None = None
    kv_transfer: tuple[int, float] | None = None  # (bytes, seconds) of that fetch, once done
    kv_transferred: bool = False  # it came with remote_kv (whether or not the fetch worked)
    # Speculative decoding: drafts verified for it, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Prompt logprobs (sampling_params.prompt_logprobs): those of prompt tokens 1, 2, ...
    # scored so far, chunk by chunk (PromptLogprob each); None when not asked for.
    prompt_logprobs: list | None = None
    # Under a thinking budget: whether the thinking has ended (None: not known yet).
    thinking_ended: bool | None = None
    # A pooling request's embedding so far (quill/contract/pooling.py): its chunks added up.
    pooled: PooledRows | None = None

    def __post_init__(self) -> None:
        if self.times is None:
            self.times = RequestTimes(arrival=self.arrival_time)
        if self.sampling_params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_reusable_tokens(self) -> int | None:
        """At most this many leading tokens may come from the prefix cache (None: any). A
        request scoring its prompt computes every position it has not scored yet: a cached
        block holds keys and values, not the logits its positions give; nor the hidden states
        a mean or the first row pools (the last row is always computed)."""
        pooling = self.sampling_params.pooling
        if pooling is not None and pooling.type != "last":
            return 0
        return None if self.prompt_scored else len(self.prompt_logprobs)

    @property
    def prompt_scored(self) -> bool:
        """Every prompt token but the first has its logprob (or none were asked for)."""
        scored = self.prompt_logprobs
        return scored is None or len(scored) >= len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED

    def metrics(self, cost=None) -> RequestMetrics:
        """Its timings so far (and `cost`, a quill.cost.live.RequestCost, when priced)."""
        t = self.times

        def since(a, b):
            return None if a is None or b is None else a - b

        end = t.finished
        return RequestMetrics(
            arrival_time=t.arrival,
            queue_time=since(t.first_scheduled, t.arrival),
            time_to_first_token=since(t.first_token, t.arrival),
            mean_inter_token_latency=t.itl_sum / t.num_itl if t.num_itl else None,
            max_inter_token_latency=t.itl_max if t.num_itl else None,
            prefill_time=since(t.first_token, t.first_scheduled),
            decode_time=since(end, t.first_token),
            e2e_latency=since(end, t.arrival),
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_output_tokens,
            num_preemptions=self.num_preemptions,
            num_cached_tokens=self.num_cached_tokens,
            predicted_time_to_first_token=self.predicted_ttft,
            flops=cost.flops if cost else None,
            bytes_moved=cost.bytes_moved if cost else None,
            cost_usd=cost.cost_usd if cost else None,
            kv_transfer_bytes=self.kv_transfer[0] if self.kv_transfer else None,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            kv_transfer_s=self.kv_transfer[1] if self.kv_transfer else None,
        )

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    def forced_thinking_token(self) -> int | None:
        """The token the reply must take next under its thinking budget (the end-of-thinking
        marker's next token once the budget is spent and the thinking goes on), or None."""
        params = self.sampling_params
        if params.thinking_budget is None or self.thinking_ended:
            return None
        end, start, out = params.thinking_end_ids, params.thinking_start_ids, self.output_token_ids
        budget = max(params.thinking_budget, len(start))  # the opening marker counts
        if len(out) < budget:
            return None
        if self.thinking_ended is None:  # decided once, when the budget is reached
            began = not start or out[: len(start)] == start
            self.thinking_ended = not began or _contains(out[:budget], end)
            if self.thinking_ended:
                return None
        forced = len(out) - budget
        if forced >= len(end):
            self.thinking_ended = True
            return None
        return end[forced]


def _contains(tokens: list[int], part: list[int]) -> bool:
    n = len(part)
    return any(tokens[i : i + n] == part for i in range(len(tokens) - n + 1))
