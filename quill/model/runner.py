"""The model runner: the torch executor that turns a step plan into sampled tokens.

It owns the model, the KV cache tensors, the attention workspaces and the sampler. Per step it
lays the scheduled tokens out flat (decodes first, no padding), builds the attention layout for
the paged cache, runs one forward pass with both passed in, maps only the rows that sample to
logits, and samples them.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from quill.engine.plan import SeqPlan, StepPlan, StepResult
from quill.model.attention import AttentionLayout, native_supported
from quill.model.llama import LlamaForCausalLM
from quill.model.sampler import Sampler, SampleResult
from quill.ops import memory
from quill.ops.reference import kv_cache_shapes

log = logging.getLogger(__name__)


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
        kv_cache_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.config = model.config
        if device.type == "cpu":
            # Denormal floats take a slow path on x86 (a 512-token prefill ran 4x slower).
            torch.set_flush_denormal(True)
        self.device = device
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype
        self.block_size = block_size
        # The end ids let the sampler hold them back until a request's min_tokens.
        self.sampler = Sampler(device, seed, end_token_ids)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.scratch_block = 0
        self.layout: AttentionLayout | None = None  # set with the cache
        self.forward = model.forward  # replaced by a compiled wrapper when compiling
        self.padded_size = lambda num_tokens: num_tokens  # compiled steps pad to a bucket

    def kv_bytes_per_block(self) -> int:
        elem = self.kv_cache_dtype.itemsize
        return self.config.kv_bytes_per_token * self.block_size * elem

    def allocate_kv_cache(self, num_blocks: int) -> None:
        c = self.config
        k_shape, v_shape = kv_cache_shapes(
            num_blocks + 1, c.num_kv_heads, c.head_dim, self.block_size, self.kv_cache_dtype
        )
        # Zeroed: masked-out keys still meet the values in P @ V, and 0 * NaN would poison it.
        # On huge pages: the blocks a step reads are scattered over the whole pool.
        dtype, dev = self.kv_cache_dtype, self.device
        self.kv_caches = [
            (memory.zeros(k_shape, dtype, dev), memory.zeros(v_shape, dtype, dev))
            for _ in range(c.num_layers)
        ]
        self.scratch_block = num_blocks
        why_not = native_supported(self.device, c.head_dim, self.block_size, self.kv_cache_dtype)
        if why_not is None:
            log.info(
                "attention: quill::paged_attention (%s library: %s) on a %s KV cache",
                torch.ops.quill.isa(),
                torch.ops.quill.attention_kernel(self.dtype, self.kv_cache_dtype),
                self.kv_cache_dtype,
            )
        else:
            log.info("attention: PyTorch path (%s), %s KV cache", why_not, self.kv_cache_dtype)
        self.layout = AttentionLayout(
            self.block_size, num_blocks, self.dtype, self.device, native=why_not is None
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        for request_id in plan.finished_request_ids:
            self.sampler.free(request_id)
        # Decodes (one query) first, then prompt chunks: attention takes each group as a slice.
        seqs = sorted(plan.seqs, key=lambda s: len(s.token_ids) > 1)
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sampling: list[SeqPlan] = []
        bs = self.block_size
        for s in seqs:
            start, n, table = s.start, len(s.token_ids), s.block_table
            input_ids.extend(s.token_ids)
            positions.extend(range(start, start + n))
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            if s.samples:
                sample_rows.append(len(input_ids) - 1)
                sampling.append(s)

        # Padding tokens (compiled runs only) write their keys to the scratch block, unread.
        num_padding = self.padded_size(len(input_ids)) - len(input_ids)
        if num_padding:
            input_ids.extend([0] * num_padding)
            positions.extend([0] * num_padding)
            slots.extend([self.scratch_block * bs] * num_padding)
        dev = self.device
        meta = self.layout.build(seqs, torch.tensor(slots, dtype=torch.long, device=dev))
        ids = torch.tensor(input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(positions, dtype=torch.long, device=dev)
        hidden = self.forward(ids, pos, self.kv_caches, meta)
        if not sample_rows:
            return StepResult({}, {})
        rows = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        logits = self.model.compute_logits(hidden[rows])
        result: SampleResult = self.sampler(logits, sampling)
        sampled = {s.request_id: t for s, t in zip(sampling, result.token_ids)}
        logprobs = {s.request_id: lp for s, lp in zip(sampling, result.logprobs) if lp is not None}
        return StepResult(sampled, logprobs)
