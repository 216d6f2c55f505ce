"""Attention kernel benchmark: one layer's paged attention, native kernel against the PyTorch path.

Why: decode at long contexts is a stream over the KV cache, so the kernel is judged by the
fraction of the machine's read bandwidth it reaches. This times one layer of the default
model's attention (9 query heads, 3 KV heads, head_dim 64, 16-token blocks scattered over the
pool) on:

- decodes: 1, 16 and 64 sequences at 1,500 tokens of context, 16 at 8,000; the KV bytes each
  call reads over its time, beside the probe's read rate with one thread and with all (30
  layers' caches are called in turn, as a step does, so no case sits in the last-level cache);
- prompt chunks: a 2,000-token prompt alone, and 512-token chunks over 512-1,536 cached tokens,
  in GFLOP/s;

for the native kernel (`quill::paged_attention`) and the PyTorch reference path (gather into a
workspace + scaled-dot-product attention), alternating the two round after round and keeping
each one's best. The probe runs between rounds, so a drifting machine shows in both. Usage:

    .venv/bin/python benchmarks/bench_attention.py [--kv-dtype bfloat16] [--q-dtype bfloat16]
        [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.contract.plan import SeqPlan  # noqa: E402
from quill.model.attention import AttentionLayout, paged_attention  # noqa: E402
from quill.ops import library, memory, probe  # noqa: E402
from quill.ops.reference import kv_cache_shapes  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, LAYERS = 9, 3, 64, 30


class Case:
    """One step's attention: `batch` sequences of `context` keys, `q_len` new tokens each."""

    def __init__(self, name, batch, context, q_len, q_dtype, kv_dtype, block=16, scatter=True):
        self.name, self.batch, self.context, self.q_len = name, batch, context, q_len
        BLOCK = block
        rng = random.Random(0)
        blocks_per_seq = -(-context // BLOCK)
        num_blocks = batch * blocks_per_seq + 8
        k_shape, v_shape = kv_cache_shapes(num_blocks + 1, KV_HEADS, HEAD_DIM, BLOCK, kv_dtype)
        cpu = torch.device("cpu")
        # One cache per layer, as the model has, used in turn: a small case does not get to
        # sit in the last-level cache between calls, as it never does in a real step.
        self.layers = []
        for _ in range(LAYERS):
            k_cache, v_cache = (
                memory.zeros(k_shape, kv_dtype, cpu),
                memory.zeros(v_shape, kv_dtype, cpu),
            )
            k_cache.normal_()
            v_cache.normal_()
            self.layers.append((k_cache, v_cache))
        self.calls = 0
        free = list(range(num_blocks))
        if scatter:  # a long-running pool's blocks; a fresh pool hands out consecutive ones
            rng.shuffle(free)
        start = context - q_len
        self.seqs = [
            SeqPlan(
                f"s{b}",
                [0] * q_len,
                start,
                context,
                [free[b * blocks_per_seq : (b + 1) * blocks_per_seq]],
                True,
            )
            for b in range(batch)
        ]
        n = batch * q_len
        self.q = torch.randn(n, HEADS, HEAD_DIM).to(q_dtype)
        self.k = torch.randn(n, KV_HEADS, HEAD_DIM).to(q_dtype)
        self.v = torch.randn(n, KV_HEADS, HEAD_DIM).to(q_dtype)
        self.slots = torch.tensor(
            [
                s.block_tables[0][p // BLOCK] * BLOCK + p % BLOCK
                for s in self.seqs
                for p in range(start, context)
            ]
        )
        self.metas = {}
        for native in (True, False):
            layout = AttentionLayout(BLOCK, num_blocks, q_dtype, cpu, native)
            self.metas[native] = layout.build(self.seqs, self.slots)
        elem = kv_dtype.itemsize
        self.kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * elem
        causal = q_len * (q_len + 1) / 2
        self.flops = 4 * HEADS * HEAD_DIM * batch * (q_len * start + causal)

    def run(self, native: bool) -> float:
        meta = self.metas[native]
        cache = self.layers[self.calls % LAYERS]
        self.calls += 1
        start = time.perf_counter()
        paged_attention(self.q, self.k, self.v, cache, meta, HEAD_DIM**-0.5)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kv-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument("--q-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--consecutive-blocks",
        action="store_true",
        help="each sequence's blocks consecutive in memory (a fresh pool), not scattered",
    )
    parser.add_argument("--reps", type=int, default=LAYERS, help="calls per side per round")
    parser.add_argument("--skip-reference", action="store_true", help="native kernel only")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lib = library.load()
    if lib is None:
        raise SystemExit("no native library for this CPU: run `make setup`")
    q_dtype, kv_dtype = getattr(torch, args.q_dtype), getattr(torch, args.kv_dtype)
    shapes = [
        ("decode 1 x 1500", 1, 1500, 1),
        ("decode 16 x 1500", 16, 1500, 1),
        ("decode 64 x 1500", 64, 1500, 1),
        ("decode 16 x 8000", 16, 8000, 1),
        ("prompt 2000 (no context)", 1, 2000, 2000),
        ("chunk 512 over 512", 1, 1024, 512),
        ("chunk 512 over 1536", 1, 2048, 512),
    ]
    scatter = not args.consecutive_blocks
    cases = [Case(*shape, q_dtype, kv_dtype, args.block_size, scatter) for shape in shapes]
    sides = [True] if args.skip_reference else [True, False]
    best = {(c.name, s): float("inf") for c in cases for s in sides}
    # The paged cache's own pattern: scattered reads of one KV head's part of a block.
    head_block = HEAD_DIM * args.block_size * kv_dtype.itemsize
    probes = {"one_thread": [], "all_threads": [], f"all_threads_{head_block}B_chunks": []}
    for r in range(args.rounds):
        probes["one_thread"].append(probe.read_bandwidth(1))
        probes["all_threads"].append(probe.read_bandwidth())
        chunked = probe.read_bandwidth(chunk_bytes=head_block)
        probes[f"all_threads_{head_block}B_chunks"].append(chunked)
        for case in cases:
            order = sides if r % 2 == 0 else sides[::-1]
            for native in order:
                case.run(native)  # warm
                for _ in range(args.reps):
                    best[case.name, native] = min(best[case.name, native], case.run(native))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    bw1, bw = max(probes["one_thread"]), max(probes["all_threads"])
    paged = max(probes[f"all_threads_{head_block}B_chunks"])
    info = machine_info(torch.get_num_threads())
    threads = torch.get_num_threads()
    flags = " ".join(info["cpu_flags"])
    print(f"\n{info['cpu']} ({flags}), {threads} threads, library {lib.isa}")
    print(f"q {args.q_dtype}, KV {args.kv_dtype}; best of {args.rounds} rounds")
    print(
        f"probe: one thread {bw1 / 1e9:.1f} GB/s, all threads {bw / 1e9:.1f} GB/s; "
        f"scattered {head_block}-byte chunks (all threads) {paged / 1e9:.1f} GB/s\n"
    )
    print(
        "| case | native ms | native | of probe | of scattered chunks | reference ms | "
        "native speed-up |"
    )
    print("|---|---|---|---|---|---|---|")
    rows = []
    for case in cases:
        t = best[case.name, True]
        ref = best.get((case.name, False))
        decode = case.q_len == 1
        rate = case.kv_bytes / t if decode else case.flops / t
        shown = f"{rate / 1e9:.1f} GB/s" if decode else f"{rate / 1e9:.0f} GFLOP/s"
        share = f"{rate / bw:.0%}" if decode else ""
        share_paged = f"{rate / paged:.0%}" if decode else ""
        ref_ms = f"{ref * 1e3:.2f}" if ref else ""
        gain = f"{ref / t:.1f}x" if ref else ""
        print(
            f"| {case.name} | {t * 1e3:.3f} | {shown} | {share} | {share_paged} | {ref_ms} | "
            f"{gain} |"
        )
        rows.append(
            {
                "case": case.name,
                "native_s": t,
                "reference_s": ref,
                "kv_bytes": case.kv_bytes,
                "flops": case.flops,
                "native_rate": rate,
                "fraction_of_probe": rate / bw if decode else None,
                "fraction_of_scattered_probe": rate / paged if decode else None,
            }
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": info,
                    "library": lib.isa,
                    "q_dtype": args.q_dtype,
                    "kv_dtype": args.kv_dtype,
                    "probe_Bps": probes,
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
