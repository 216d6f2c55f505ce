"""The model runner: the torch executor that turns a step plan into sampled tokens.

It owns the model, the KV cache tensors, the attention workspaces and the sampler. A step is
two calls: `forward` lays the scheduled tokens out flat (one-query rows first, no padding),
builds the attention layout for the paged cache, runs one pass with both passed in and maps
only the rows that sample to logits (and scores the prompt rows of requests that asked for
prompt logprobs, quill/model/prompt_logprobs.py); `sample` takes those logits with each row's
sampling inputs (parameters, history, token mask) and picks the tokens, or, for a sequence that
carries drafts (speculative decoding), takes the logits of each drafted position and one more
and keeps the drafts the model agrees with, plus one token. Between the two is where a token
mask is made.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from quill.contract.kv_format import KVCacheFormat
from quill.contract.plan import PromptLogprob, SeqPlan, StepPlan, StepResult
from quill.contract.pooling import PooledRows
from quill.model.attention import AttentionLayout, native_supported
from quill.model.llama import LlamaForCausalLM
from quill.model.prompt_logprobs import score_rows
from quill.model.sampler import Sampler, SampleResult
from quill.ops import memory
from quill.ops.reference import kv_cache_shapes, kv_torch_dtype

log = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    """A pass's logits: per sampling sequence in `rows` order, its `num_logits` rows (one; a
    sequence with drafts: one per drafted position and one more)."""

    logits: torch.Tensor | None  # [sum of num_sample_rows, vocab]; None when nothing samples
    rows: list[SeqPlan]
    # Per sequence that scored prompt tokens: their logprobs, in order.
    prompt_logprobs: dict[str, list[PromptLogprob]] = field(default_factory=dict)
    # Per pooling sequence: what its rows give (quill/contract/pooling.py).
    pooled: dict[str, PooledRows] = field(default_factory=dict)


class ModelRunner:
    """Executes steps on one device. The KV pool has one extra scratch block for padding."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        device: torch.device,
        dtype: torch.dtype,
        block_size: int,
        seed: int = 0,
        end_token_ids: Sequence[int] = (),
        kv_cache_dtype: KVCacheFormat | torch.dtype | None = None,
        pooled_head: torch.nn.Module | None = None,
    ) -> None:
        self.model = model
        # An encoder's sentence-transformers Dense modules, run on each pooled vector
        # (quill/model/pooled_head.py).
        self.pooled_head = pooled_head
        self.config = model.config
        # An encoder (quill/model/bert.py) keeps no KV cache: each prompt is one whole pass.
        self.encoder = getattr(model, "is_encoder", False)
        if device.type == "cpu":
            # Denormal floats take a slow path on x86 (a 512-token prefill ran 4x slower).
            torch.set_flush_denormal(True)
        self.device = device
        self.dtype = dtype
        if not isinstance(kv_cache_dtype, KVCacheFormat):  # one torch dtype for K and V
            name = str(kv_cache_dtype or dtype).removeprefix("torch.")
            kv_cache_dtype = KVCacheFormat(name, name)
        self.kv_format = kv_cache_dtype
        self.block_size = block_size
        # The end ids let the sampler hold them back until a request's min_tokens.
        self.sampler = Sampler(device, seed, end_token_ids)
        self.kv_groups = model.config.kv_groups
        # Each layer's (keys, values): its slot's tensors (layers of different groups share a
        # slot's tensors, each through its own group's blocks).
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch_block = 0
        self.layouts: list[AttentionLayout] = []  # one per KV group, set with the cache
        self.forward = model.forward  # replaced by a compiled wrapper when compiling
        self.padded_size = lambda num_tokens: num_tokens  # compiled steps pad to a bucket
        # Decode-only steps' own compiled forward (a GPU's CUDA graphs: quill/model/compile.py),
        # with its own buckets; None: they run as any step.
        self.decode_forward = None
        # Tensor-parallel ranks but the first run the layers only: sampling is rank 0's.
        self.computes_logits = True
        # Fetches prompt KV a prefill instance computed (quill/disagg/fetch.py) beside the
        # steps, for plans with kv_fetches; set by the engine worker.
        self.kv_fetcher = None

    def kv_shapes(self, num_blocks: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One layer slot's K and V cache shapes for `num_blocks` blocks."""
        c = self.config
        return kv_cache_shapes(
            num_blocks, c.num_kv_heads, c.head_dim, self.block_size, *self.kv_dtypes
        )

    @property
    def kv_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        return kv_torch_dtype(self.kv_format.key), kv_torch_dtype(self.kv_format.value)

    def kv_bytes_per_block(self) -> int:
        """A pool block's bytes: `layers_per_block` layers' keys and values (int8's scales
        included)."""
        k_shape, v_shape = self.kv_shapes(1)
        k_dtype, v_dtype = self.kv_dtypes
        per_layer = math.prod(k_shape) * k_dtype.itemsize + math.prod(v_shape) * v_dtype.itemsize
        return per_layer * self.kv_groups.layers_per_block

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        if self.encoder:  # the blocks only count what the scheduler admits
            self.scratch_block = num_blocks
            log.info("attention: bidirectional within each prompt, no KV cache (an encoder)")
            return
        k_shape, v_shape = self.kv_shapes(num_blocks + 1)
        # Zeroed: masked-out keys still meet the values in P @ V, and 0 * NaN would poison it.
        # On huge pages: the blocks a step reads are scattered over the whole pool.
        (k_dtype, v_dtype), dev = self.kv_dtypes, self.device
        kv = self.kv_groups
        slots = [
            (memory.zeros(k_shape, k_dtype, dev), memory.zeros(v_shape, v_dtype, dev))
            for _ in range(kv.layers_per_block)
        ]
        self.kv_caches = [slots[j] for j in kv.layer_slots]
        self.scratch_block = num_blocks
        why_not = native_supported(self.device, c.head_dim, self.block_size, k_dtype, v_dtype)
        if why_not is None:
            log.info(
                "attention: quill::paged_attention (%s library: %s) on a %s KV cache",
                torch.ops.quill.isa(),
                torch.ops.quill.attention_kernel(self.dtype, k_dtype, v_dtype),
                self.kv_format,
            )
        else:
            log.info("attention: PyTorch path (%s), %s KV cache", why_not, self.kv_format)
        self.layouts = [
            AttentionLayout(
                self.block_size, num_blocks, self.dtype, self.device, why_not is None, window, g
            )
            for g, window in enumerate(kv.group_windows)
        ]

    def _positions_and_slots(
        self, seqs: list[SeqPlan], single_positions: list[int], chunks: list[SeqPlan], padding: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Each token's position, and its cache slot (block * block_size + offset) in each KV
        group: a one-query row's from its one position, a chunk's by tensor arithmetic over
        its positions."""
        bs = self.block_size
        singles = seqs[: len(single_positions)]
        positions = [torch.tensor(single_positions, dtype=torch.long)]
        chunk_positions = [torch.arange(s.start, s.start + len(s.token_ids)) for s in chunks]
        positions.extend(chunk_positions)
        if padding:
            positions.append(torch.zeros(padding, dtype=torch.long))
        group_slots = []
        for g in range(self.kv_groups.num_groups):
            slots = [
                torch.tensor(
                    [
                        s.block_tables[g][p // bs] * bs + p % bs
                        for s, p in zip(singles, single_positions)
                    ],
                    dtype=torch.long,
                )
            ]
            for s, at in zip(chunks, chunk_positions):
                table = torch.tensor(s.block_tables[g], dtype=torch.long)
                slots.append(table[at // bs] * bs + at % bs)
            if padding:
                slots.append(torch.full((padding,), self.scratch_block * bs, dtype=torch.long))
            group_slots.append(slots[0] if len(slots) == 1 else torch.cat(slots))
        return (positions[0] if len(positions) == 1 else torch.cat(positions)), group_slots

    def execute(self, plan: StepPlan) -> StepResult:
        """The executor's one call: start the plan's KV fetches, `forward`, then `sample`;
        the result reports the fetches that ended meanwhile (a plan of fetches alone waits a
        little for one to end)."""
        fetcher = self.kv_fetcher
        if plan.kv_fetches:
            fetcher.start(plan.kv_fetches)
        if not plan.seqs:
            result = StepResult({})
            if fetcher is not None:
                fetcher.collect(result, wait_s=0.05)
            return result
        result = self.sample(self.forward_pass(plan))
        if fetcher is not None and fetcher.busy:
            fetcher.collect(result)
        return result

    @torch.inference_mode()
    def forward_pass(self, plan: StepPlan) -> ForwardOutput:
        """Run the model over the plan's tokens; the logits of the rows that sample."""
        for request_id in plan.finished_request_ids:
            self.sampler.free(request_id)
        if self.encoder:
            return self._encode(plan)
        # One-query rows first, then longer chunks: attention takes each group as a slice.
        seqs = sorted(plan.seqs, key=lambda s: not s.is_single_query)
        input_ids: list[int] = []
        single_positions: list[int] = []
        sample_rows: list[int] = []
        sampling: list[SeqPlan] = []
        chunks: list[SeqPlan] = []
        scoring: list[tuple[SeqPlan, int]] = []  # (sequence, its first row)
        pooling: list[tuple[SeqPlan, int]] = []
        for s in seqs:
            if s.prompt_logprob_token_ids:
                scoring.append((s, len(input_ids)))
            if s.pooling is not None:
                pooling.append((s, len(input_ids)))
            input_ids.extend(s.token_ids)
            if s.is_single_query:
                single_positions.append(s.start)
            else:
                chunks.append(s)
            if s.samples:
                end = len(input_ids)
                if s.draft_token_ids:
                    sample_rows.extend(range(end - 1 - len(s.draft_token_ids), end))
                else:
                    sample_rows.append(end - 1)
                sampling.append(s)
        # Padding tokens (compiled runs only) write their keys to the scratch block, unread.
        decode_only = not chunks and self.decode_forward is not None
        forward = self.decode_forward if decode_only else self.forward
        padded_size = self.decode_forward.padded_size if decode_only else self.padded_size
        num_padding = padded_size(len(input_ids)) - len(input_ids)
        input_ids.extend([0] * num_padding)
        pos, slots = self._positions_and_slots(seqs, single_positions, chunks, num_padding)
        dev = self.device
        metas = [layout.build(seqs, s.to(dev)) for layout, s in zip(self.layouts, slots)]
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = pos.to(dev)
        layer_metas = [metas[g] for g in self.kv_groups.layer_groups]
        hidden = forward(ids, pos, self.kv_caches, layer_metas)
        if not self.computes_logits:
            return ForwardOutput(None, [])
        scored = self._score_prompts(hidden, scoring) if scoring else {}
        pooled = self._pool(hidden, pooling) if pooling else {}
        if not sample_rows:
            return ForwardOutput(None, [], scored, pooled)
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        return ForwardOutput(self.model.compute_logits(hidden[rows]), sampling, scored, pooled)

    def _encode(self, plan: StepPlan) -> ForwardOutput:
        """An encoder's step: each sequence a whole prompt (the scheduler never cuts one),
        pooled; nothing samples."""
        ids: list[int] = []
        positions: list[int] = []
        types: list[int] = []
        pooling: list[tuple[SeqPlan, int]] = []
        for s in plan.seqs:
            if s.pooling is not None:
                pooling.append((s, len(ids)))
            ids.extend(s.token_ids)
            positions.extend(range(s.start, s.start + s.num_tokens))
            second = s.num_tokens if s.second_segment is None else s.second_segment
            types.extend([0] * second + [1] * (s.num_tokens - second))
        dev = self.device
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev),
                            [s.num_tokens for s in plan.seqs],
                            torch.tensor(types, dtype=torch.long, device=dev))  # fmt: skip
        return ForwardOutput(None, [], {}, self._pool(hidden, pooling) if pooling else {})

    def _pool(self, hidden: torch.Tensor, pooling: list[tuple[SeqPlan, int]]) -> dict:
        """Each pooling sequence's rows after the model's final norm (its last_hidden_state),
        in one pass: their fp32 sum and count for a mean, else the one row."""
        rows: list[int] = []
        for s, first in pooling:
            if s.pooling == "mean":
                rows.extend(range(first, first + s.num_tokens))
            else:
                rows.append(first if s.pooling == "cls" else first + s.num_tokens - 1)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        states = self.model.norm(hidden[index]).float()
        pooled, i = {}, 0
        for s, _ in pooling:
            n = s.num_tokens if s.pooling == "mean" else 1
            if s.pool_classify:  # a cross-encoder's score: its classification head
                logits = self.model.classify(hidden[index[i : i + 1]])[0]
                pooled[s.request_id] = (logits.float().tolist(), 1)
            elif s.pool_logit_ids is not None:  # a reranker's yes / no: the head, on one row
                logits = self.model.compute_logits(hidden[index[i : i + 1]])[0]
                ids = torch.tensor(s.pool_logit_ids, dtype=torch.long, device=self.device)
                pooled[s.request_id] = (logits[ids].float().tolist(), 1)
            elif self.pooled_head is not None:  # an encoder's whole prompt: pooled, projected
                vector = self.pooled_head(states[i : i + n].mean(0, keepdim=True))[0]
                pooled[s.request_id] = (vector.tolist(), 1)
            else:
                pooled[s.request_id] = (states[i : i + n].sum(0).tolist(), n)
            i += n
        return pooled

    def _score_prompts(
        self, hidden: torch.Tensor, scoring: list[tuple[SeqPlan, int]]
    ) -> dict[str, list[PromptLogprob]]:
        """The prompt logprobs of every scoring sequence's rows, in one pass over the head."""
        rows, targets = [], []
        for s, first in scoring:
            rows.extend(range(first, first + s.num_prompt_logprob_rows))
            targets.extend(s.prompt_logprob_token_ids)
        dev = self.device
        num_top = max(s.prompt_logprobs for s, _ in scoring)
        entries = score_rows(
            self.model.compute_logits,
            hidden[torch.tensor(rows, dtype=torch.long, device=dev)],
            torch.tensor(targets, dtype=torch.long, device=dev),
            num_top,
            self.config.vocab_size,
        )
        scored, i = {}, 0
        for s, _ in scoring:
            n, k = s.num_prompt_logprob_rows, s.prompt_logprobs
            mine = entries[i : i + n]
            scored[s.request_id] = mine if k == num_top else [(a, b, c[:k]) for a, b, c in mine]
            i += n
        return scored

    @torch.inference_mode()
    def sample(self, forward: ForwardOutput) -> StepResult:
        """Pick each sampling row's tokens from its logits and its sampling inputs."""
        if forward.logits is None:
            return StepResult({}, {}, forward.prompt_logprobs, pooled=forward.pooled)
        rows = forward.rows
        if any(s.draft_token_ids for s in rows):
            tokens, token_logprobs = self.sampler.verify(forward.logits, rows)
            sampled = {s.request_id: t for s, t in zip(rows, tokens)}
            logprobs = {s.request_id: lp for s, lp in zip(rows, token_logprobs) if lp is not None}
            return StepResult(sampled, logprobs, forward.prompt_logprobs, pooled=forward.pooled)
        result: SampleResult = self.sampler(forward.logits, rows)
        sampled = {s.request_id: [t] for s, t in zip(rows, result.token_ids)}
        logprobs = {s.request_id: [lp] for s, lp in zip(rows, result.logprobs) if lp is not None}
        return StepResult(sampled, logprobs, forward.prompt_logprobs, pooled=forward.pooled)
