"""Tensor parallelism on this host: TP=1, 2 and 3 in one run, beside the cost model's price.

Why: a rank holds 1/N of each layer, but on one host the ranks also share its cores and
memory, and every layer pays two all-reduces (gloo over loopback TCP). This measures what that
nets on the machine at hand, and holds the cost model's prediction for the same split (priced
with the all-reduce `quill cost calibrate` measured here) against it.

The model is SmolLM2-135M's shape with 6 query heads and 6 KV heads of 96 (so that 2 and 3
ranks both divide it; the real one has 9 and 3 of 64: TP=3 only), dummy weights, bf16 and not
quantized (as the calibration that prices it), engine defaults otherwise. Each side is an
engine of its own (`LLM(tensor_parallel_size=N)`: N processes, each with its share of the
cores: TP=1 two threads, TP=2 one each, TP=3 one each over 2 cores), measured at decode
batches of 1 and 64 (32-token prompts); sides alternate round after round, the best round
kept. Usage:

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--sizes 1,2,3] [--batches 1,64]
        [--rounds 2] [--hardware FILE] [--json out.json]

Without --hardware it uses this machine's saved calibration, and runs `quill cost calibrate
--quick` first when there is none (or it lacks the all-reduce of these sizes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.cost.batch import BatchShape  # noqa: E402
from quill.cost.hardware import HardwareSpec  # noqa: E402
from quill.cost.live import find_calibration_file  # noqa: E402
from quill.cost.model import ModelSpec  # noqa: E402
from quill.cost.step import CostModel  # noqa: E402
from quill.model.default_model import default_model_dir  # noqa: E402

PROMPT_TOKENS = 32


def model_dir(directory: Path) -> Path:
    config = json.loads((default_model_dir() / "config.json").read_text())
    config.update(num_attention_heads=6, num_key_value_heads=6, head_dim=96)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def decode_steps(llm: LLM, batch: int, steps: int) -> dict:
    """`batch` requests decoding together: the median decode step and output tok/s."""
    engine = llm.engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        prompt = torch.randint(100, 40000, (PROMPT_TOKENS,), generator=gen).tolist()
        engine.add_request(prompt, params)
    durations, tokens, start = [], 0, None
    while engine.has_unfinished_requests():
        outputs, stats = engine.step_with_stats()
        if stats is not None and stats.num_prefill_tokens == 0:
            if start is None:
                start = time.perf_counter() - stats.duration
            durations.append(stats.duration)
            tokens += stats.num_decode_tokens
    wall = time.perf_counter() - start
    return {"step_p50_ms": 1000 * statistics.median(durations), "tokens_per_s": tokens / wall}


def hardware_for(sizes: list[int], given: str | None) -> HardwareSpec:
    if given:
        return HardwareSpec.resolve(given)
    path = find_calibration_file("bfloat16")
    needed = [n for n in sizes if n > 1]
    if path is not None:
        spec = HardwareSpec.load(path)
        if all(spec.allreduce_on_host(n) for n in needed):
            print(f"hardware: {path}")
            return spec
    from quill.cost import calibrate

    print("no calibration with these all-reduces here: `quill cost calibrate --quick` first")
    args = ["--quick", "--no-progress", "--tp-sizes", ",".join(map(str, needed))]
    if calibrate.main(args) != 0:
        raise SystemExit("calibration failed")
    return HardwareSpec.load(find_calibration_file("bfloat16"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", default="1,2,3")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--steps", type=int, default=24, help="decode steps per measurement")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--hardware", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    batches = [int(x) for x in args.batches.split(",")]
    threads = torch.get_num_threads()
    hardware = hardware_for(sizes, args.hardware)
    torch.set_num_threads(threads)  # calibrate sets the process-wide pool
    runs: dict = {str(n): {str(b): [] for b in batches} for n in sizes}
    with tempfile.TemporaryDirectory() as tmp:
        path = model_dir(Path(tmp))
        for r in range(args.rounds):
            order = sizes[r % len(sizes) :] + sizes[: r % len(sizes)]
            for n in order:
                with LLM(
                    str(path),
                    load_format="dummy",
                    tokenizer=str(default_model_dir()),
                    tensor_parallel_size=n,
                    kv_cache_memory=1 << 30,
                    quantization="none",  # as the calibration's engine: the cost model's weights
                ) as llm:
                    decode_steps(llm, 4, 4)  # warm up
                    for b in batches:
                        run = decode_steps(llm, b, args.steps)
                        runs[str(n)][str(b)].append(run)
                        print(f"round {r}, TP={n}, batch {b}: {run}", flush=True)
        model = ModelSpec.from_path(path, 2)
    best = {
        n: {b: min(rs, key=lambda x: x["step_p50_ms"]) for b, rs in per.items()}
        for n, per in runs.items()
    }
    predicted = {}
    context = PROMPT_TOKENS + args.steps // 2  # the middle of the measured decode
    for n in sizes:
        cost = CostModel(model, hardware, n)
        predicted[str(n)] = {
            str(b): 1000 * cost.price(BatchShape.decodes(b, context)).predicted_s for b in batches
        }
    info = machine_info(threads)
    results = {"machine": info, "hardware": hardware.name, "best": best, "rounds": runs,
               "predicted_step_ms": predicted, "config": vars(args)}  # fmt: skip
    print(f"\n{info['cpu']}, {info['logical_cpus']} cpus, torch {info['torch']}, {info['date']}")
    print(f"`{info['command']}`; cost model on {hardware.name}\n")
    print("| TP | " + " | ".join(f"batch {b}: step p50 (predicted), tok/s" for b in batches) + " |")
    print("|---|" + "---|" * len(batches))
    for n in sizes:
        cells = []
        for b in batches:
            m = best[str(n)][str(b)]
            p = predicted[str(n)][str(b)]
            cells.append(f"{m['step_p50_ms']:.1f} ms ({p:.1f} ms), {m['tokens_per_s']:.1f}")
        print(f"| {n} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
