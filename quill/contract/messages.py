"""The messages between the front end and the engine, in or across processes.

The front end sends `EngineRequest`s (one sequence each: token ids, resolved limits), aborts
and utility calls; the engine answers each add at once (`AddResult`: accepted, or why not) and
after each step sends `EngineOutputs`: per request the tokens it gained and, once, how it ended,
plus one `StepStats`, which is all an observer (the Prometheus export) reads of the engine.
In one process (`LLMEngine`) these are passed as objects; between processes they go through
`quill.contract.codec`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from quill.contract.outputs import RequestMetrics
from quill.contract.plan import PromptLogprob, RemoteKV, SampleLogprobs
from quill.contract.sampling_params import SamplingParams


@dataclass
class EngineRequest:
    """One sequence to serve, validated by the front end (ids in the vocabulary, max_tokens
    resolved against the context); the engine checks what needs its state (KV room, SLO)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    max_tokens: int
    priority: int = 0
    cache_salt: str | None = None
    ttft_slo: float | None = None
    # Disaggregation. A prefill instance's request: keep its prompt's KV this many seconds
    # after it ends, for a decode instance. A decode instance's request: its prompt's KV and
    # first token, computed by a prefill instance.
    kv_lease_s: float | None = None
    remote_kv: RemoteKV | None = None


@dataclass
class AbortRequests:
    request_ids: list[str]
    # "abort" (the client went away), or "stop" (the front end found a stop string).
    reason: str = "abort"


@dataclass
class UtilityCall:
    """Ask the engine process something outside the request flow (tests, tools)."""

    call_id: int
    name: str
    args: list[Any] = field(default_factory=list)


@dataclass
class ErrorInfo:
    """Why the engine refused a request: `kind` is "invalid" (400), "overloaded" (503 with
    Retry-After) or "engine" (500)."""

    kind: str
    message: str
    param: str | None = None
    retry_after: float | None = None


@dataclass
class AddResult:
    request_id: str
    error: ErrorInfo | None = None
    # What of the request's constraint is not enforced (schema keywords the grammar ignores).
    warnings: list[str] = field(default_factory=list)


@dataclass
class RequestUpdate:
    """What one request gained in one step; `finish_reason` is set on its last update."""

    request_id: str
    new_token_ids: list[int]
    metrics: RequestMetrics
    new_logprobs: list[SampleLogprobs] | None = None
    # On a request's first update, once its prompt is scored: prompt tokens 1, 2, ...'s
    # logprobs (sampling_params.prompt_logprobs).
    prompt_logprobs: list[PromptLogprob] | None = None
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    error: str | None = None
    error_param: str | None = None  # set when the error is the request's own (a 4xx)
    kv_lease: RemoteKV | None = None  # on the last update of a leased request
    embedding: list[float] | None = None  # on the last update of a pooling request

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StepPrice:
    """A step's price under the cost model, against what it took."""

    predicted_s: float
    measured_s: float
    roofline_efficiency: float
    mfu: float
    mbu: float
    # The two floors of the roofline: the step's FLOPs at peak arithmetic, its bytes at peak
    # bandwidth (the console draws both beside the measured time).
    arithmetic_s: float = 0.0
    movement_s: float = 0.0
    cost_usd: float | None = None  # the measured seconds at the configured price, if any


@dataclass
class KVTransferStats:
    """Disaggregation's running totals on one instance (quill/disagg), sent with each step's
    stats once it has a KV link."""

    fetches: int = 0  # decode side: prompts' KV received from prefill instances
    fetched_bytes: int = 0
    fetch_failures: int = 0
    recomputes: int = 0  # failed fetches whose prompt was computed here instead
    # Prompt tokens computed here for requests whose KV came from a prefill instance (~0
    # unless fetches failed or such requests were preempted).
    transferred_prompt_tokens: int = 0
    sends: int = 0  # prefill side: leases sent to decode instances
    sent_bytes: int = 0
    leases: int = 0  # leases held now
    lease_expiries: int = 0  # leases freed unfetched


@dataclass
class StructuredStats:
    """Structured output's running totals on one engine (quill/structured)."""

    grammars_compiled: int = 0  # matchers made (one per constrained request)
    compile_seconds: float = 0.0
    masks: int = 0  # token masks computed (one per constrained row per step)
    mask_seconds: float = 0.0
    over_budget: int = 0  # replies ended for a mask that cost more than its budget


@dataclass
class SpecDecodeStats:
    """Speculative decoding's running totals on one engine (vLLM's spec_decode counters):
    requests verified with drafts, drafts made and accepted, and per draft position the drafts
    accepted through it; decodes asked for drafts and those that got some; and how many drafts
    the switch allowed in the last step (0: off, the batch is too busy for them to pay)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    num_eligible: int = 0
    num_proposed: int = 0
    drafts_allowed: int = 0

    @property
    def acceptance_rate(self) -> float | None:
        n = self.num_draft_tokens
        return self.num_accepted_tokens / n if n else None

    def on_verified(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        per_position = self.accepted_per_position
        for i in range(num_accepted):
            per_position[i] += 1


@dataclass
class StepStats:
    """What one step did and left: the one thing observers read of the engine."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_requests: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    duration: float
    # The prefix cache's running totals, in prompt tokens looked up and found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    price: StepPrice | None = None  # when a cost model with a hardware spec is on
    kv_transfer: KVTransferStats | None = None  # when this instance has a KV link
    structured: StructuredStats | None = None  # when structured output is on
    spec_decode: SpecDecodeStats | None = None  # when speculative decoding is on
    # The load routers read (GET /v1/loads): blocks in some table, of how many; the tokens of
    # every running and waiting request (prompt and output so far).
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_tokens_in_flight: int = 0

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class EngineOutputs:
    """One step's news: request updates, and the step's stats (no tokens: it ran no pass)."""

    updates: list[RequestUpdate] = field(default_factory=list)
    stats: StepStats | None = None


@dataclass
class UtilityResult:
    call_id: int
    value: Any = None
    error: str | None = None


@dataclass
class EngineInfo:
    """What the front end must know of the engine it talks to, sent once at start-up."""

    model_path: str
    tokenizer_source: str
    eos_token_ids: list[int]
    vocab_size: int
    max_model_len: int
    num_kv_tokens: int
    pid: int = 0
    hardware_name: str | None = None  # the spec the cost model prices steps on, if any
    price_per_hour: float | None = None  # USD, when requests are priced
    task: str = "generate"  # generate, embed or score (quill.config.resolve_task)
    cross_encoder: bool = False  # an encoder with a classification head: scores pairs
    encoder: bool = False  # bidirectional (ModelConfig.causal false): each prompt pooled whole


@dataclass
class EngineFailed:
    """Everything in flight fails with `message`: a step raised (the engine serves on), or
    the engine process is going down (`fatal`)."""

    message: str
    fatal: bool = True
