"""What the engine hands back: per-request outputs (cumulative and incremental) and timings."""

from __future__ import annotations

from dataclasses import dataclass, field

from quill.contract.plan import RemoteKV

# One generated token's logprobs: {token id: logprob}, the chosen token always included.
TokenLogprobs = dict[int, float]


@dataclass
class RequestMetrics:
    """Timings of one request in seconds of the engine's clock, measured from its arrival."""

    arrival_time: float
    queue_time: float | None
    time_to_first_token: float | None
    mean_inter_token_latency: float | None
    max_inter_token_latency: float | None
    prefill_time: float | None
    decode_time: float | None
    e2e_latency: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    num_preemptions: int
    num_cached_tokens: int | None  # prompt tokens read from the prefix cache (None: not admitted)
    # What admission control predicted for time_to_first_token when the request arrived.
    predicted_time_to_first_token: float | None
    # The request's share of what its steps cost (see quill.cost.live): its own FLOPs, its KV
    # traffic plus an even share of each weight read it shared; dollars with a price per hour.
    flops: float | None = None
    bytes_moved: float | None = None
    cost_usd: float | None = None
    # A decode instance's request whose prompt KV came from a prefill instance: the transfer.
    kv_transfer_bytes: int | None = None
    kv_transfer_s: float | None = None
    # Speculative decoding: drafts verified for this request, and how many of them held (each
    # accepted draft is a token that cost no pass of its own).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class CompletionOutput:
    """The generated text so far. `delta_*` hold what is new since the previous output."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # stop | length | abort | error
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprobs] | None = None
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: str | None = None  # set when finish_reason is "error"
    # Set when that error is the request's own (its constraint failed), naming the field:
    # a client error, where None is the engine's.
    error_param: str | None = None
    # Asked for with sampling_params.prompt_logprobs: per prompt token its logprob and the top
    # n, as generated tokens' (None for the first token, which nothing predicts), and its rank
    # in the vocabulary (1: the model's most likely token there). Set once the prompt is in.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None
    # A prefill instance's leased request: where a decode instance fetches its prompt's KV.
    kv_transfer: RemoteKV | None = None
    # A pooling request's embedding (sampling_params.pooling), once its prompt is in.
    embedding: list[float] | None = None
