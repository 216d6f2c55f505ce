"""Routing two replicas on a shared-prefix workload: round-robin, least-load, cache-aware.

Two `quill serve` replicas, each pinned to one core, behind `quill router` (in this process),
started afresh for every policy; the same items (Poisson arrivals, `--tenants` shared contexts
together larger than one replica's KV pool) through each, policies in alternating order over
`--rounds`. Beside each measured run, the simulator's prediction for the same items and policy:
`--hardware` is this machine's one-core calibration (`quill cost calibrate --quick --threads
1`; default: the one `quill bench experiments` keeps), refitted on steps the replicas record
serving a held-out workload first. `quill bench experiments --only routing` runs the same.

    .venv/bin/python benchmarks/bench_routing.py --rounds 2 --out routing.json
    .venv/bin/python benchmarks/bench_routing.py --kill-at 8   # a replica SIGKILLed mid-run
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

from quill.bench.routing import (  # noqa: E402
    POLICIES,
    Comparison,
    SharedPrefixWorkload,
    compare,
    model_and_vocab,
    replica_flags,
    run_real,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--hardware", default=None, help="one-core calibration (the simulator)")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--question", type=int, default=48)
    p.add_argument("--reply", type=int, default=32)
    p.add_argument("--requests", type=int, default=120)
    p.add_argument(
        "--rate",
        type=float,
        default=None,
        help="requests/s (default: --load x --rate-of's simulated saturation)",
    )
    p.add_argument("--load", type=float, default=1.0)
    p.add_argument("--rate-of", default="round-robin", choices=POLICIES)
    p.add_argument(
        "--calibration-requests",
        type=int,
        default=60,
        help="held-out requests for the serving fit (0: the calibration as it is)",
    )
    p.add_argument("--kv-cache-memory", default="128MiB")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--policies", default=",".join(POLICIES))
    p.add_argument(
        "--kill-at",
        type=float,
        default=None,
        metavar="SECONDS",
        help="instead: one cache-aware run whose first replica is SIGKILLed this far in",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    args = p.parse_args()  # fmt: skip

    work = SharedPrefixWorkload(args.tenants, args.context, args.question, args.reply,
                                args.requests, args.rate or 1.0, args.seed)  # fmt: skip
    if args.kill_at is not None:
        return _kill_run(args, work)
    if args.hardware is None:
        from quill.bench.experiments.split import one_core_hardware

        args.hardware = str(one_core_hardware())
    comparison = Comparison(args.model, args.kv_cache_memory, args.rounds, args.load,
                            args.rate_of, args.rate, args.calibration_requests,
                            tuple(args.policies.split(",")))  # fmt: skip
    result = compare(comparison, work, args.hardware)
    result = {
        "date": str(date.today()),
        "machine": platform.processor() or platform.machine(),
        "command": " ".join(sys.argv),
    } | result
    _print(result)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


def _kill_run(args, work: SharedPrefixWorkload) -> int:
    model_path, vocab = model_and_vocab(args.model)
    if args.rate is None:
        work.rate = 2.0
    items = work.items()
    flags = replica_flags(args.model, args.kv_cache_memory)
    real = run_real("cache-aware", flags, model_path, items, work.prompts(items, vocab),
                    kill_at=args.kill_at)  # fmt: skip
    real = {"date": str(date.today()), "command": " ".join(sys.argv)} | real
    print(json.dumps(real, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(real, indent=1) + "\n")
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
            cells = [
                f"{_f(real[key])} / {_f(sim[key])}"
                for key in ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate")
            ]
            print(f"{name:12} " + " ".join(f"{c:>16}" for c in cells))
    print("(measured / simulated)")


def _f(x) -> str:
    return "-" if x is None else f"{x:.3g}"


if __name__ == "__main__":
    t0 = time.monotonic()
    code = main()
    print(f"({time.monotonic() - t0:.0f} s)")
    sys.exit(code)
