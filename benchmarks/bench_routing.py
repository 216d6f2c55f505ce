"""Routing two replicas on a shared-prefix workload: round-robin, least-load, cache-aware.

Two `quill serve` replicas, each pinned to one core, behind `quill router` (in this process),
started afresh for every policy; the same items (Poisson arrivals, `--tenants` shared contexts
together larger than one replica's KV pool) through each, policies in alternating order over
`--rounds`. Beside each measured run, the simulator's prediction for the same items and policy
(`--hardware`: a `quill cost calibrate --threads 1` file of this machine, one core per replica).

    .venv/bin/python benchmarks/bench_routing.py --hardware cpu1.json --out routing.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from quill.bench.routing import SharedPrefixWorkload, run_real, simulate  # noqa: E402

POLICIES = ["round-robin", "least-load", "cache-aware"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--hardware", required=True, help="calibration for one core (the simulator)")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--question", type=int, default=48)
    p.add_argument("--reply", type=int, default=32)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument("--rate", type=float, default=None, help="default: 0.9 x the simulated "
                   "saturation of cache-aware's layout")  # fmt: skip
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kill-at", type=float, default=None, metavar="SECONDS",
                   help="instead: one cache-aware run whose first replica is SIGKILLed this "
                   "far in")  # fmt: skip
    p.add_argument("--out", default=None)
    args = p.parse_args()

    from quill.config import EngineConfig
    from quill.cost.hardware import HardwareSpec
    from quill.cost.model import ModelSpec
    from quill.engine_args import parse_bytes
    from quill.model.factory import model_path_of
    from quill.sim.config import SimConfig

    model_path = str(model_path_of(EngineConfig(model=args.model)))
    kv_bytes = parse_bytes(args.kv_cache_memory)
    spec = ModelSpec.from_path(model_path)
    config = SimConfig.create(spec, HardwareSpec.resolve(args.hardware), max_num_seqs=256,
                              max_num_batched_tokens=512, kv_cache_memory=kv_bytes,
                              context_len=8192)  # fmt: skip
    work = SharedPrefixWorkload(args.tenants, args.context, args.question, args.reply,
                                args.requests, args.rate or 1.0, args.seed)  # fmt: skip
    if args.rate is None:
        burst = SharedPrefixWorkload(**{**vars(work), "rate": float("inf")})
        top = simulate("cache-aware", config, burst.items())
        work.rate = 0.9 * top["output_tokens_per_s"] / args.reply
        print(f"rate: {work.rate:.3g} requests/s (0.9 x the simulated saturation)")
    items = work.items()
    from quill.frontend.tokenizer import Tokenizer

    vocab = range(100, Tokenizer.load(Path(model_path)).vocab_size - 100)
    prompts = work.prompts(items, vocab)
    flags = ["--served-model-name", "smol", "--kv-cache-memory", args.kv_cache_memory,
             "--quantization", "none", "--log-level", "warning", "--no-access-log"]  # fmt: skip
    if args.model:
        flags.insert(0, args.model)
    if args.kill_at is not None:
        real = run_real("cache-aware", flags, model_path, items, prompts, kill_at=args.kill_at)
        print(json.dumps(real, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(real, indent=1) + "\n")
        return 0
    policies = args.policies.split(",")
    runs: dict[str, list] = {name: [] for name in policies}
    for round_ in range(args.rounds):
        order = policies if round_ % 2 == 0 else policies[::-1]
        for policy in order:
            real = run_real(policy, flags, model_path, items, prompts)
            print(f"{policy}: {json.dumps(real)}", flush=True)
            runs[policy].append(real)
    predicted = {name: simulate(name, config, items) for name in policies}
    pool_tokens = config.num_blocks * config.block_size
    result = {
        "date": str(date.today()),
        "machine": platform.processor() or platform.machine(),
        "command": " ".join(sys.argv),
        "workload": vars(work)
        | {
            "pool_tokens_per_replica": pool_tokens,
            "contexts_tokens": args.tenants * args.context,
        },  # fmt: skip
        "measured": runs,
        "simulated": predicted,
    }
    _print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _print(result: dict) -> None:
    w = result["workload"]
    print(f"\n{w['tenants']} tenants x {w['context']} tokens = {w['contexts_tokens']} tokens of "
          f"shared context; {w['pool_tokens_per_replica']} tokens of KV per replica; "
          f"{w['requests']} requests at {w['rate']:.3g}/s")  # fmt: skip
    print(f"{'policy':12} {'TTFT p50':>16} {'TTFT p90':>16} {'out tok/s':>16} {'hit rate':>14}")
    for name, runs in result["measured"].items():
        sim = result["simulated"][name]
        for real in runs:
            cells = []
            for key in ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate"):
                cells.append(f"{_f(real[key])} / {_f(sim[key])}")
            print(f"{name:12} " + " ".join(f"{c:>16}" for c in cells))
    print("(measured / simulated)")


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    print(f"({time.monotonic() - t0:.0f} s)")
    sys.exit(code)
