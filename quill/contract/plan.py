"""The step plan: the one description of a step that crosses from the engine to whatever runs it.

The engine core decides; an executor does. Between them passes only a `StepPlan`: plain data
(ids, token ids, positions, block tables, sampling parameters) that serialises to JSON. The
torch model runner executes it, the cost model prices it, the simulator advances virtual time by
that price, and a prefill process can later send it to a decode process. Because every consumer
reads the same plan, what counts as prefill and what counts as decode is defined once, here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Protocol

from quill.contract.pooling import PooledRows
from quill.contract.sampling_params import SamplingParams


@dataclass
class RemoteKV:
    """A prompt's KV cache that a prefill instance holds under lease for a decode instance:
    where to fetch it (its KV link), which of its blocks, and the first token it sampled."""

    host: str
    port: int
    request_id: str  # the prefill instance's id of the request
    block_ids: list[int]
    num_tokens: int  # the prompt tokens whose keys and values the blocks hold
    first_token_id: int
    # Set by the decode instance: its leading blocks found in its own prefix cache, not sent.
    num_cached_blocks: int = 0

    @property
    def num_tokens_to_fetch(self) -> int:
        """The prompt tokens a fetch moves: those of its blocks past the ones cached here
        (counted by tokens, so a partly filled last block counts its tokens only)."""
        blocks = len(self.block_ids)
        return self.num_tokens * (blocks - self.num_cached_blocks) // blocks if blocks else 0


@dataclass
class KVFetch:
    """Start fetching a request's prompt KV from a prefill instance into its blocks here.

    The executor fetches beside the steps that follow (the request takes no part in them) and
    reports the outcome in the result of a later step; the request decodes once it is in."""

    request_id: str
    block_table: list[int]  # the request's blocks here: the prompt's come first
    source: RemoteKV


@dataclass(slots=True)
class SeqPlan:
    """One request's share of a step: compute `token_ids` at positions `start`, `start + 1`, ..."""

    request_id: str
    token_ids: list[int]
    start: int  # the request's num_computed_tokens before the step
    num_prompt_tokens: int
    # KV blocks holding positions 0 .. context_len - 1, one table per KV group
    # (quill/contract/kv_groups.py; NULL_BLOCK: freed, behind a sliding group's window).
    block_tables: list[list[int]]
    samples: bool  # the step reaches the request's last token, so it yields a new token
    sampling_params: SamplingParams | None = None  # set when `samples`
    # The token history, sent only when a penalty needs it (they grow with every token).
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # The tokens the sampler may choose from, as a bitmask over the vocabulary (bit t of byte
    # t // 8, least significant bit first); None: every token. Set by structured output.
    token_bitmask: bytes | None = None
    # Tokens guessed ahead (speculative decoding): `token_ids` ends with them, after the
    # request's last token; the sampler verifies them in this pass. None: none.
    draft_token_ids: list[int] | None = None
    # Prompt logprobs (a request scoring its prompt): the prompt tokens this chunk's first rows
    # score, in order (the row at position start + i gives the logprob of prompt token
    # start + i + 1), and how many top tokens to report beside each. None: none.
    prompt_logprob_token_ids: list[int] | None = None
    prompt_logprobs: int = 0
    # Pooling (quill/contract/pooling.py): what this chunk's rows give the request's
    # embedding ("mean", "cls", "last"); None: nothing.
    pooling: str | None = None
    pool_logit_ids: list[int] | None = None  # the pooled row's logits of these, not its state
    pool_classify: bool = False  # the pooled row through the classification head
    second_segment: int | None = None  # an encoder's: where token type 1 begins

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens whose keys and values this request's attention reads after the step."""
        return self.start + len(self.token_ids)

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids) if self.draft_token_ids else 0

    @property
    def num_sample_rows(self) -> int:
        """Rows of logits the sampler takes for this sequence: one per drafted position and
        one more when it samples; none otherwise."""
        return 1 + self.num_drafts if self.samples else 0

    @property
    def num_prompt_logprob_rows(self) -> int:
        return len(self.prompt_logprob_token_ids) if self.prompt_logprob_token_ids else 0

    @property
    def num_logits(self) -> int:
        """Rows of logits the step computes for this sequence: its prompt-scoring rows, then
        its sample rows."""
        return self.num_prompt_logprob_rows + self.num_sample_rows

    @property
    def is_decode(self) -> bool:
        """The one definition: a decode computes exactly one token, one that follows the prompt
        (and with speculation the drafts guessed after it, verified in the same pass).

        Everything else (prompt chunks, and the recomputation of a preempted request's prompt
        and output) is prefill.
        """
        drafts = self.draft_token_ids  # (num_drafts, without a call: once per sequence a step)
        n = 1 + len(drafts) if drafts else 1
        return len(self.token_ids) == n and self.start >= self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        return not self.is_decode

    @property
    def is_single_query(self) -> bool:
        """One query row: a decode, or a one-token prompt chunk. Not a kind of step, but what
        the attention kernels care about (their one-query path)."""
        return len(self.token_ids) == 1


@dataclass(slots=True)
class StepPlan:
    """Everything an executor needs for one pass through the model."""

    step_id: int
    seqs: list[SeqPlan]
    # Requests that ended since the previous plan: executors drop any state they keep for them.
    finished_request_ids: list[str] = field(default_factory=list)
    # Prompt KV to start fetching from prefill instances (a plan may hold only these, and no
    # sequences: then the executor waits a little for fetches to end, and reports them).
    kv_fetches: list[KVFetch] = field(default_factory=list)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_decode_tokens(self) -> int:
        return self.token_counts()[1]

    def token_counts(self) -> tuple[int, int]:
        """(tokens, of them decode tokens) in one pass: the engine counts both every step.
        SeqPlan.is_decode, inline."""
        tokens = decode = 0
        for s in self.seqs:
            n = len(s.token_ids)
            tokens += n
            drafts = s.draft_token_ids
            if n == (1 + len(drafts) if drafts else 1) and s.start >= s.num_prompt_tokens:
                decode += n
        return tokens, decode

    @property
    def num_draft_tokens(self) -> int:
        return sum(s.num_drafts for s in self.seqs)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @property
    def num_sampled(self) -> int:
        return sum(1 for s in self.seqs if s.samples)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepPlan:
        seqs = []
        for s in d["seqs"]:
            s = dict(s)
            if s.get("sampling_params") is not None:
                s["sampling_params"] = SamplingParams(**s["sampling_params"])
            seqs.append(SeqPlan(**s))
        return cls(d["step_id"], seqs, list(d.get("finished_request_ids", [])))


# A sampled token's logprob, and the top n as (token id, logprob).
SampleLogprobs = tuple[float, list[tuple[int, float]]]
# A scored prompt token's logprob, its rank in the vocabulary (1: the most likely), and the
# top n as (token id, logprob).
PromptLogprob = tuple[float, int, list[tuple[int, float]]]


@dataclass
class StepResult:
    """What an executor returns: per sampling request the tokens it chose, in order (one; with
    draft tokens, the accepted drafts and one more), their logprobs where asked, and the
    logprobs of the prompt tokens that sequences scored."""

    sampled: dict[str, list[int]]
    logprobs: dict[str, list[SampleLogprobs]] = field(default_factory=dict)
    # Per request scoring its prompt: the logprobs of the prompt tokens its sequence's
    # `prompt_logprob_token_ids` named, in order.
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
    # Fetches (KVFetch) that ended since the last result: (bytes, seconds) of each that
    # arrived, and why each that failed did.
    kv_fetched: dict[str, tuple[int, float]] = field(default_factory=dict)
    kv_fetch_failed: dict[str, str] = field(default_factory=dict)
    # Per pooling request: what this step's chunk of its prompt gave (PooledRows).
    pooled: dict[str, PooledRows] = field(default_factory=dict)


class Executor(Protocol):
    """Runs step plans: the torch model runner, or the simulator's cost-model executor."""

    def execute(self, plan: StepPlan) -> StepResult: ...
