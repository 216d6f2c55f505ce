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
    # the int8 cache against the 16-bit one, native both sides, Llama 3.2 1B's heads:
    .venv/bin/python benchmarks/bench_attention.py --kv-dtype int8 --against-kv-dtype bfloat16 \
        --shape llama-3.2-1b --decodes-only
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
from quill.ops.reference import key_parts, kv_cache_shapes, value_parts  # noqa: E402

# (query heads, KV heads, head_dim, layers): the default model's, and Llama 3.2 1B's.
SHAPES = {"default": (9, 3, 64, 30), "llama-3.2-1b": (32, 8, 64, 16)}
HEADS, KV_HEADS, HEAD_DIM, LAYERS = SHAPES["default"]


def element_bytes(dtype: torch.dtype) -> float:
    """Cache bytes per element: int8 codes carry an fp16 scale per 32 (csrc/cache_layout.h)."""
    return 1 + 2 / 32 if dtype == torch.int8 else dtype.itemsize


def filled_cache(shape, dtype: torch.dtype, keys: bool) -> torch.Tensor:
    cache = memory.zeros(shape, dtype, torch.device("cpu"))
    if dtype != torch.int8:
        return cache.normal_()
    cache.random_(-127, 128)
    block_size = shape[3] if keys else shape[2] // 17 * 16
    parts = key_parts(cache) if keys else value_parts(cache, block_size)
    parts[1].uniform_(0.005, 0.02)  # scales: codes of N(0, 1)-sized values
    return cache


class Case:
    """One step's attention: `batch` sequences of `context` keys, `q_len` new tokens each, on
    a cache of each of `kv_dtypes`."""

    def __init__(self, name, batch, context, q_len, q_dtype, kv_dtypes, block=16, scatter=True):
        self.name, self.batch, self.context, self.q_len = name, batch, context, q_len
        BLOCK = block
        rng = random.Random(0)
        blocks_per_seq = -(-context // BLOCK)
        num_blocks = batch * blocks_per_seq + 8
        # One cache per layer, as the model has, used in turn: a small case does not get to
        # sit in the last-level cache between calls, as it never does in a real step.
        self.layers = {}
        for kv_dtype in kv_dtypes:
            k_shape, v_shape = kv_cache_shapes(num_blocks + 1, KV_HEADS, HEAD_DIM, BLOCK, kv_dtype)
            self.layers[kv_dtype] = [
                (filled_cache(k_shape, kv_dtype, True), filled_cache(v_shape, kv_dtype, False))
                for _ in range(LAYERS)
            ]
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
            layout = AttentionLayout(BLOCK, num_blocks, q_dtype, torch.device("cpu"), native)
            self.metas[native] = layout.build(self.seqs, self.slots)
        self.kv_bytes = {
            d: batch * context * KV_HEADS * HEAD_DIM * 2 * element_bytes(d) for d in kv_dtypes
        }
        causal = q_len * (q_len + 1) / 2
        self.flops = 4 * HEADS * HEAD_DIM * batch * (q_len * start + causal)

    def run(self, native: bool, kv_dtype: torch.dtype) -> float:
        meta = self.metas[native]
        cache = self.layers[kv_dtype][self.calls % LAYERS]
        self.calls += 1
        start = time.perf_counter()
        paged_attention(self.q, self.k, self.v, cache, meta, HEAD_DIM**-0.5)
        return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    kv_choices = ["float32", "bfloat16", "float16", "int8"]
    parser.add_argument("--kv-dtype", default="bfloat16", choices=kv_choices)
    parser.add_argument(
        "--against-kv-dtype",
        default=None,
        choices=kv_choices,
        help="compare the native kernel on this cache dtype (not the PyTorch path)",
    )
    parser.add_argument("--shape", default="default", choices=sorted(SHAPES))
    parser.add_argument("--q-dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--consecutive-blocks",
        action="store_true",
        help="each sequence's blocks consecutive in memory (a fresh pool), not scattered",
    )
    parser.add_argument("--reps", type=int, default=None, help="calls per side per round")
    parser.add_argument("--skip-reference", action="store_true", help="native kernel only")
    parser.add_argument("--decodes-only", action="store_true", help="skip the prompt cases")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    global HEADS, KV_HEADS, HEAD_DIM, LAYERS
    HEADS, KV_HEADS, HEAD_DIM, LAYERS = SHAPES[args.shape]
    reps = args.reps or LAYERS
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
    if args.decodes_only:
        shapes = shapes[:4]
    # Sides: (native?, cache dtype); the second is the PyTorch path or the other cache dtype.
    sides = [(True, kv_dtype)]
    if args.against_kv_dtype:
        sides.append((True, getattr(torch, args.against_kv_dtype)))
    elif not args.skip_reference:
        sides.append((False, kv_dtype))
    kv_dtypes = sorted({d for _, d in sides}, key=str)
    scatter = not args.consecutive_blocks
    cases = [Case(*shape, q_dtype, kv_dtypes, args.block_size, scatter) for shape in shapes]
    best = {(c.name, s): float("inf") for c in cases for s in sides}
    # The paged cache's own pattern: scattered reads of one KV head's part of a block
    # (the probe takes multiples of 256 bytes: an int8 chunk's scales left out).
    head_block = int(HEAD_DIM * args.block_size * element_bytes(kv_dtype)) // 256 * 256
    probes = {"one_thread": [], "all_threads": [], f"all_threads_{head_block}B_chunks": []}
    for r in range(args.rounds):
        probes["one_thread"].append(probe.read_bandwidth(1))
        probes["all_threads"].append(probe.read_bandwidth())
        chunked = probe.read_bandwidth(chunk_bytes=head_block)
        probes[f"all_threads_{head_block}B_chunks"].append(chunked)
        for case in cases:
            order = sides if r % 2 == 0 else sides[::-1]
            for side in order:
                case.run(*side)  # warm
                for _ in range(reps):
                    best[case.name, side] = min(best[case.name, side], case.run(*side))
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    bw1, bw = max(probes["one_thread"]), max(probes["all_threads"])
    paged = max(probes[f"all_threads_{head_block}B_chunks"])
    info = machine_info(torch.get_num_threads())
    threads = torch.get_num_threads()
    flags = " ".join(info["cpu_flags"])
    print(f"\n{info['cpu']} ({flags}), {threads} threads, library {lib.isa}")
    shape = f"{HEADS} heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, {LAYERS} layers"
    print(f"{args.shape} ({shape}); q {args.q_dtype}, KV {args.kv_dtype}; best of {args.rounds}")
    print(
        f"probe: one thread {bw1 / 1e9:.1f} GB/s, all threads {bw / 1e9:.1f} GB/s; "
        f"scattered {head_block}-byte chunks (all threads) {paged / 1e9:.1f} GB/s\n"
    )
    other = sides[1] if len(sides) > 1 else None
    other_name = (
        f"native {str(other[1]).removeprefix('torch.')}" if other and other[0] else "reference"
    )
    print(
        f"| case | native ms | native | of probe | of scattered chunks | {other_name} ms | "
        f"{other_name} rate | {other_name} of probe | time vs {other_name} |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []

    def rate_of(case, side):
        t = best[case.name, side]
        return case.kv_bytes[side[1]] / t if case.q_len == 1 else case.flops / t

    for case in cases:
        t = best[case.name, sides[0]]
        decode = case.q_len == 1
        rate = rate_of(case, sides[0])
        shown = f"{rate / 1e9:.1f} GB/s" if decode else f"{rate / 1e9:.0f} GFLOP/s"
        share = f"{rate / bw:.0%}" if decode else ""
        share_paged = f"{rate / paged:.0%}" if decode else ""
        o_ms = o_rate = o_share = ratio = ""
        o_t = None
        if other:
            o_t = best[case.name, other]
            orate = rate_of(case, other)
            o_ms = f"{o_t * 1e3:.3f}"
            o_rate = f"{orate / 1e9:.1f} GB/s" if decode else f"{orate / 1e9:.0f} GFLOP/s"
            o_share = f"{orate / bw:.0%}" if decode else ""
            ratio = f"{t / o_t:.2f}x"
        print(
            f"| {case.name} | {t * 1e3:.3f} | {shown} | {share} | {share_paged} | {o_ms} | "
            f"{o_rate} | {o_share} | {ratio} |"
        )
        rows.append(
            {
                "case": case.name,
                "native_s": t,
                "other_s": o_t,
                "other": other_name if other else None,
                "kv_bytes": case.kv_bytes[kv_dtype],
                "flops": case.flops,
                "native_rate": rate,
                "fraction_of_probe": rate / bw if decode else None,
                "fraction_of_scattered_probe": rate / paged if decode else None,
                "other_fraction_of_probe": rate_of(case, other) / bw if other and decode else None,
            }
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "machine": info,
                    "library": lib.isa,
                    "shape": args.shape,
                    "q_dtype": args.q_dtype,
                    "kv_dtype": args.kv_dtype,
                    "against": other_name if other else None,
                    "probe_Bps": probes,
                    "rows": rows,
                },
                indent=2,
            )
        )
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
