"""The weight products of a decode step: quill's kernels against PyTorch's, by rows.

Why: at a small batch a decode step's time is its weight bytes, so the int8 kernel is judged by
the rate it streams them at, against the read probe of the same run. One "pass" here is what
a step multiplies: every layer's projections of the default model (q/k/v merged 960 x 576,
o 576 x 576, gate/up merged 3072 x 576, down 576 x 1536; 30 layers, so nothing is read hot
from the last-level cache), and, reported apart, the output head (49152 x 576). Each side
runs its own weights in turn, alternating round by round, best of the rounds:

- `q8`: quill::q8_linear (csrc/qlinear.cpp), 34 + 2 bytes per 32 weights (one row reads 34:
  it needs no code sums);
- `q4`: quill::q4_linear, Q4_1's 16 + 4 bytes per 32 weights;
- `q5`: quill::q5_linear, Q5_1's codes one a byte, 32 + 4 bytes per 32 weights;
- `dense`: quill::dense_linear (csrc/dense.cpp) on bf16 weights as stored, 2 bytes per weight;
- `f16`: quill::dense_linear on fp16 weights (a GGUF file's F16 tensors, read where they lie);
- `bf16`: F.linear on bf16 weights (PyTorch's CPU GEMM, oneDNN / MKL), 2 bytes per weight;
- `int8pack`: torch._weight_int8pack_mm (per-channel int8, bf16 activations), the kernel
  quill's int8 used before its own.

Usage:

    .venv/bin/python benchmarks/bench_qlinear.py [--rows 1,2,4,8,16] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.model.linear import best_time  # noqa: E402
from quill.ops import library, probe, qlinear  # noqa: E402

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
HEAD_SHAPE = (49152, 576)


class Side:
    """One way of multiplying, with its own copy of every weight of a pass."""

    def __init__(self, name: str, shapes: list[tuple[int, int]], seed: int) -> None:
        self.name = name
        g = torch.Generator().manual_seed(seed)
        self.weights, self.bytes, self.unread_by_one_row = [], 0, 0
        for n, k in shapes:
            w = torch.randn(n, k, generator=g) * 0.05
            if name == "q8":
                packed = qlinear.pack(*qlinear.quantize_q8_0(w))
                self.weights.append(packed)
                self.bytes += sum(
                    t.numel() * t.element_size() for t in (packed.codes, packed.scales, packed.sums)
                )
                self.unread_by_one_row += packed.sums.numel() * 2
            elif name == "q4":
                packed = qlinear.pack_q4(*qlinear.quantize_q4_1(w))
                self.weights.append(packed)
                self.bytes += sum(
                    t.numel() * t.element_size()
                    for t in (packed.codes, packed.scales, packed.offsets)
                )
            elif name == "q5":
                codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
                d = (torch.rand(n, k // 32, generator=g) * 0.01).half()
                packed = qlinear.pack_q5(codes, d, -16 * d)
                self.weights.append(packed)
                self.bytes += sum(
                    t.numel() * t.element_size()
                    for t in (packed.codes, packed.scales, packed.offsets)
                )
            elif name in ("bf16", "dense", "f16"):
                self.weights.append(w.half() if name == "f16" else w.bfloat16())
                self.bytes += n * k * 2
            else:
                scales = w.abs().amax(1) / 127
                codes = torch.round(w / scales[:, None]).to(torch.int8)
                self.weights.append((codes, scales.bfloat16()))
                self.bytes += n * k + n * 2
        if name in ("q8", "q4", "q5"):
            qlinear.move_to_huge_pages(self.weights)  # as the engine keeps them

    def bytes_read(self, rows: int) -> int:
        return self.bytes - (self.unread_by_one_row if rows == 1 else 0)

    def run(self, inputs: dict[int, torch.Tensor]) -> None:
        for w in self.weights:
            if self.name == "q8":
                qlinear.native_q8_linear(inputs[w.in_features], w)
            elif self.name == "q4":
                qlinear.native_q4_linear(inputs[w.in_features], w)
            elif self.name == "q5":
                qlinear.native_q5_linear(inputs[w.in_features], w)
            elif self.name in ("dense", "f16"):
                torch.ops.quill.dense_linear(inputs[w.shape[1]], w)
            elif self.name == "bf16":
                F.linear(inputs[w.shape[1]], w)
            else:
                torch._weight_int8pack_mm(inputs[w[0].shape[1]], *w)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default="q8,q4,dense,bf16,int8pack")
    parser.add_argument("--json")
    args = parser.parse_args()
    native = library.load()
    if native is None:
        raise SystemExit("needs the native library (`make setup`)")
    rows_list = [int(r) for r in args.rows.split(",")]
    names = args.sides.split(",")
    passes = {
        "layers": {n: Side(n, LAYER_SHAPES * LAYERS, i) for i, n in enumerate(names)},
        "head": {n: Side(n, [HEAD_SHAPE], 10 + i) for i, n in enumerate(names)},
    }
    best: dict = {}
    probes = []
    for r in range(args.rounds):
        probes.append(probe.read_bandwidth())
        order = names if r % 2 == 0 else names[::-1]
        for rows in rows_list:
            inputs = {k: torch.randn(rows, k).bfloat16() for k in (576, 1536)}
            for part, sides in passes.items():
                for name in order:
                    t = best_time(lambda s=sides[name], x=inputs: s.run(x), repeats=3)
                    key = (part, rows, name)
                    best[key] = min(best.get(key, float("inf")), t)
        print(f"round {r + 1}/{args.rounds} done", flush=True)
    bw = max(probes)
    info = machine_info(torch.get_num_threads())
    print(f"\n{info['cpu']} ({' '.join(info['cpu_flags'])}), {torch.get_num_threads()} threads")
    print(f"library {native.isa}; probe (all threads) {bw / 1e9:.1f} GB/s; best of {args.rounds}\n")
    header = "| pass | rows | " + " | ".join(f"{n} ms (GB/s, of probe)" for n in names)
    header += " | q8 / bf16 time | q8 / int8pack time | dense / bf16 time |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    rows_out = []
    for part, sides in passes.items():
        for rows in rows_list:
            cells, record = [], {"pass": part, "rows": rows}
            for name in names:
                t = best[(part, rows, name)]
                rate = sides[name].bytes_read(rows) / t
                cells.append(f"{1e3 * t:.2f} ({rate / 1e9:.1f}, {100 * rate / bw:.0f}%)")
                record[name] = {"seconds": t, "bytes": sides[name].bytes_read(rows), "Bps": rate}
            ratios = [
                f"{best[(part, rows, mine)] / best[(part, rows, other)]:.2f}"
                if other in names and mine in names
                else ""
                for mine, other in (("q8", "bf16"), ("q8", "int8pack"), ("dense", "bf16"))
            ]
            print(f"| {part} | {rows} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
            rows_out.append(record)
    if args.json:
        info["command"] = " ".join(sys.argv)
        out = {"machine": info, "library": native.isa, "probe_Bps": probes, "rows": rows_out}
        Path(args.json).write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
