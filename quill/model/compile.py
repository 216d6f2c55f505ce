"""Optional `torch.compile` of the model's dense path, for a fixed set of token counts.

Each distinct number of tokens in a step compiles once (tens of seconds on a small CPU), so the
runner pads every step up to a bucket (powers of two, then the token budget) and compiles each
bucket on first use, logging it. Attention is an opaque custom op and its layout tensors are
marked dynamic, so varying context lengths do not recompile; but each mix of attention groups
(decodes only, a first prompt chunk, later chunks, both) and a single decode still compile once
each per bucket (up to ~5 graphs, ~50 s each on 2 cores). Inductor's caches go under
`$QUILL_CACHE/inductor`, so a restart reuses earlier work. With freezing, weights become
constants that oneDNN can pre-pack. Off by default: on an AVX2 CPU in fp32 it measured no gain
(71 ms against 68 ms eager per batch-1 step), the matrix products being MKL's either way.

On a GPU only decode steps (every row one query) are compiled, with `mode="reduce-overhead"`:
each bucket's step is captured as CUDA graphs and replayed in one launch. A few-token step there
is bound by launching kernels, not by the card: eager, a Llama-3.1-8B batch-1 step launched
~1,830 kernels in 42 ms while its weights take 3.5 ms to read and the card was busy 9% of the
step (docs/benchmarks.md, "CUDA on an H200"). The KV cache is marked static, so the graphs
write it in place; prompt chunks, bound by arithmetic, stay eager.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import fields

import torch

from quill.model.attention import AttentionMetadata
from quill.model.default_model import cache_dir

log = logging.getLogger(__name__)


def bucket_sizes(token_budget: int) -> list[int]:
    sizes, n = [], 1
    while n < token_budget:
        sizes.append(n)
        n *= 2
    return sizes + [token_budget]


class BucketedForward:
    """Calls a compiled forward at the smallest bucket that holds the step's tokens."""

    def __init__(self, forward, buckets: list[int], mode: str | None = None) -> None:
        self.compiled = torch.compile(forward, dynamic=False, mode=mode)
        self.buckets = buckets
        self.seen: set[int] = set()

    def padded_size(self, num_tokens: int) -> int:
        return next((b for b in self.buckets if b >= num_tokens), num_tokens)

    def __call__(self, input_ids, positions, kv_caches, metas: list[AttentionMetadata]):
        # The layout's shapes change every step but only the opaque attention op reads them:
        # symbolic sizes keep them from triggering recompiles.
        distinct = {id(m): m for m in metas}.values()
        for holder in [*distinct, *(m.reference for m in distinct)]:
            if holder is None:
                continue
            for field in fields(holder):
                tensor = getattr(holder, field.name)
                if isinstance(tensor, torch.Tensor) and field.name != "slot_mapping":
                    for dim in range(tensor.dim()):
                        torch._dynamo.maybe_mark_dynamic(tensor, dim)
        n = input_ids.shape[0]
        if n not in self.seen:
            self.seen.add(n)
            log.info("compiling the model for %d tokens per step (once; cached on disk)", n)
            start = time.perf_counter()
            out = self.compiled(input_ids, positions, kv_caches, metas)
            log.info("compiled %d-token step in %.1f s", n, time.perf_counter() - start)
            return out
        return self.compiled(input_ids, positions, kv_caches, metas)


def compile_runner(runner, token_budget: int, decode_only: bool | None = None) -> None:
    """Switch a ModelRunner to compiled, bucketed forward passes: every step's on a CPU; on a
    GPU (or with `decode_only`) decode steps' alone, as CUDA graphs."""
    import torch._inductor.config as inductor_config

    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache_dir() / "inductor"))
    inductor_config.fx_graph_cache = True
    if decode_only is None:
        decode_only = runner.device.type == "cuda"
    if decode_only:
        for keys, values in runner.kv_caches:
            torch._dynamo.mark_static_address(keys)
            torch._dynamo.mark_static_address(values)
        runner.decode_forward = BucketedForward(
            runner.model.forward, bucket_sizes(token_budget), mode="reduce-overhead"
        )
        return
    inductor_config.freezing = True
    bucketed = BucketedForward(runner.model.forward, bucket_sizes(token_budget))
    runner.forward = bucketed
    runner.padded_size = bucketed.padded_size
