"""What prefix caching costs when nothing is shared, measured offline (no HTTP, less noise).

Two engines in one process, one with prefix caching and one without, generate the same batches
of random prompts (token ids drawn afresh each round, so nothing is ever cached), alternating
which goes first. Reported: each round's wall time and the median ratio on / off.

    .venv/bin/python benchmarks/bench_prefix_overhead.py [--rounds 4] [--prompts 24]
        [--out docs/results/bench_prefix_overhead.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # benchmarks/ is not installed

from benchmarks.engine.machine import machine_info  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.model.default_model import default_model_dir  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument(
        "--out", type=Path, default=REPO / "docs/results/bench_prefix_overhead.json"
    )
    args = parser.parse_args()
    model = str(default_model_dir())
    engines = {
        "on": LLM(model, enable_prefix_caching=True, kv_cache_memory=512 << 20),
        "off": LLM(model, enable_prefix_caching=False, kv_cache_memory=512 << 20),
    }
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    seconds: dict[str, list[float]] = {"on": [], "off": []}
    for r in range(args.rounds):
        rng = random.Random(r)
        prompts = [
            [rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.prompts)
        ]
        for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
            start = time.perf_counter()
            outs = engines[mode].generate(prompts, params, use_tqdm=False)
            seconds[mode].append(time.perf_counter() - start)
            assert all(o.metrics.num_cached_tokens == 0 for o in outs)
            print(f"round {r} caching {mode}: {seconds[mode][-1]:.2f} s", flush=True)
    ratios = [a / b for a, b in zip(seconds["on"], seconds["off"])]
    result = {
        "benchmark": "prefix caching overhead with nothing shared (offline engine)",
        "machine": machine_info(threads=os.cpu_count() or 1),
        "settings": {**vars(args), "out": str(args.out)},
        "seconds": seconds,
        "time_on_over_off": ratios,
        "median_time_on_over_off": statistics.median(ratios),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"time with caching / without: median {statistics.median(ratios):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
