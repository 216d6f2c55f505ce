"""The stored-type products alone: GGUF K-quant (and IQ4_XS) weights read in place by rows
(quill::kquant_linear), the same weights repacked in tiles (quill::kquant_tile_linear), and the
tiles dequantized a chunk at a time into PyTorch's bf16 product (kquant.dequantized_linear: the
long-step path where it measures faster), by token rows, on this machine's native library.

Random super-blocks at a real layer's shape (default Llama-3.2-1B's gate/up: 16,384 x 2,048,
and its down projection 2,048 x 8,192). Sides alternate within each round; the best of the
rounds is reported, as GB/s of weights read (what a decode step is bound by) and GOP/s (2 x
rows x N x K a second: what a prompt chunk is bound by). The bandwidth probe's read rate is
printed beside them.

    .venv/bin/python benchmarks/bench_kquant.py --types Q4_K,Q6_K,IQ4_XS --rows 1,8,64,512
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from quill.ops import kquant, library


def random_weight(ggml_type: int, rows: int, supers: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    size = kquant.BLOCK_BYTES[ggml_type]
    raw = rng.integers(0, 256, size=(rows, supers, size), dtype=np.uint8)
    for offset in kquant.FP16_FIELDS[ggml_type]:
        halves = (rng.standard_normal((rows, supers)) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = halves.view(np.uint8).reshape(rows, supers, 2)
    return torch.from_numpy(raw.reshape(rows, supers * size))


def timed(fn, budget_s: float = 0.4) -> float:
    """Seconds a call, the best of as many calls as fit in the budget (at least 3)."""
    fn()
    best, spent, calls = float("inf"), 0.0, 0
    while calls < 3 or spent < budget_s:
        start = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - start
        best, spent, calls = min(best, elapsed), spent + elapsed, calls + 1
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default="Q4_K,Q5_K,Q6_K,IQ4_XS")
    parser.add_argument("--shapes", default="16384x2048,2048x8192", help="N x K, comma-separated")
    parser.add_argument("--rows", default="1,4,8,16,64,512")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args()
    native = library.load()
    if native is None:
        raise SystemExit("no native library for this CPU: run `make setup`")
    from quill.ops.probe import read_bandwidth

    torch.manual_seed(0)
    print(f"library {native.isa}, {torch.get_num_threads()} threads; read probe "
          f"{read_bandwidth() / 1e9:.1f} GB/s")  # fmt: skip
    results = []
    for name in args.types.split(","):
        ggml_type = kquant.type_of(name)
        for shape in args.shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            weight = random_weight(ggml_type, n, k // kquant.SUPER, seed=n + k)
            tiled = ggml_type in kquant.TILE_TYPES  # Q2_K, Q3_K: rows only
            tiles = torch.ops.quill.kquant_pack(weight, ggml_type, None) if tiled else None
            for rows in (int(r) for r in args.rows.split(",")):
                x = torch.randn(rows, k, dtype=torch.bfloat16)
                sides = {
                    "rows": lambda x=x, w=weight, t=ggml_type: torch.ops.quill.kquant_linear(
                        x, w, t, None, None
                    ),
                    "tiles": lambda x=x, w=tiles, t=ggml_type, n=n: (
                        torch.ops.quill.kquant_tile_linear(x, w, t, n, None)
                    ),
                    "dequantized": lambda x=x, w=tiles, t=ggml_type, n=n: kquant.dequantized_linear(
                        x, w, t, n
                    ),
                }
                if not tiled:
                    sides = {"rows": sides["rows"]}
                best = dict.fromkeys(sides, float("inf"))
                for _ in range(args.rounds):
                    for side, fn in sides.items():
                        best[side] = min(best[side], timed(fn))
                row = {"type": name, "n": n, "k": k, "rows": rows}
                for side, seconds in best.items():
                    row[side] = {
                        "ms": seconds * 1e3,
                        "gb_s": weight.numel() / seconds / 1e9,
                        "gop_s": 2 * rows * n * k / seconds / 1e9,
                    }
                results.append(row)
                print(
                    f"{name:7s} {n:6d}x{k:<5d} rows {rows:4d}: "
                    + "  ".join(
                        f"{side} {row[side]['ms']:8.3f} ms {row[side]['gb_s']:6.1f} GB/s "
                        f"{row[side]['gop_s']:7.1f} GOP/s"
                        for side in sides
                    ),
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"isa": native.isa, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
