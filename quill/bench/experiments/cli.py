"""`quill bench experiments`: regenerate docs/experiments.md and its figures in one command.

Exposed as `add_experiments_parser(subparsers)` for the `quill bench` command and as
`main(argv)` to run on its own; both take the same flags.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from quill.bench.experiments.context import DEFAULT_KV_CACHE_MEMORY, Settings

DESCRIPTION = """\
Run the experiments (each a real measurement on this machine beside the cost model's or the
simulator's prediction) and regenerate docs/experiments.md, its figures and raw numbers:
  reading       a prompt in one pass against a reply in one pass per token; the course's table
  batching      decode step and tokens/s from 1 to 128 sequences, under the roofline
  cost          seconds and dollars per million output tokens, batch 1 against a full batch
  interference  16 streams and a 2000-token prompt: one pass against chunks; disaggregation
  split         the same on two pinned instances: colocated against prefill + decode, for real
  load          TTFT and ITL against request rate, `quill serve` against the simulator
  routing       two replicas on shared prefixes: round-robin, least-load, cache-aware routers
Full: about 11 minutes on a quiet 2-core machine, and 7 more for routing (a minute more with
--recalibrate, another the first time the split calibrates one core); --quick: under 4, and
about 2 more for routing.
"""


def _configure(p: argparse.ArgumentParser) -> None:
    from quill.engine_args import parse_bytes

    p.add_argument(
        "--only",
        metavar="NAME[,NAME]",
        help="run only these experiments (the document keeps the others' last numbers)",
    )
    p.add_argument("--quick", action="store_true", help="a short version of each experiment")
    p.add_argument(
        "--price-per-hour",
        type=float,
        default=0.10,
        help="USD per machine-hour for the cost experiment (default 0.10, an example: about a "
        "cloud 2-vCPU VM)",
    )
    p.add_argument("--hardware", metavar="FILE", help="calibration file (default: the saved one)")
    p.add_argument(
        "--recalibrate",
        action="store_true",
        help="measure a quick calibration now instead of using the saved one",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_bytes,
        default=DEFAULT_KV_CACHE_MEMORY,
        help="the KV pool a server is assumed to have, for the batch caps (default 4GiB, the "
        "engine's CPU default ceiling)",
    )
    p.add_argument(
        "--interconnect",
        type=float,
        default=1.25e9,
        help="bytes/s between two machines for simulated disaggregation (default 1.25e9: "
        "10 Gbit Ethernet)",
    )
    p.add_argument("--doc", type=Path, help="the document (default: docs/experiments.md)")
    p.add_argument(
        "--out", type=Path, help="figures and raw numbers (default: docs/figures/experiments)"
    )
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def add_experiments_parser(subparsers) -> argparse.ArgumentParser:
    """Register `experiments` on the `quill bench` sub-commands."""
    parser = subparsers.add_parser(
        "experiments",
        help="regenerate docs/experiments.md: measurements beside the cost model's predictions",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    parser.set_defaults(func=lambda args: run(args, shlex.join(["quill", *sys.argv[1:]])))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="quill bench experiments",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser.parse_args(argv)
    return run(args, shlex.join(["quill", "bench", "experiments", *argv]))


def run(args: argparse.Namespace, command: str) -> int:
    import logging

    from quill.bench.experiments.driver import EXPERIMENTS, default_root, run_experiments

    # httpx logs every request at INFO: the load experiment's lines would bury the progress.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    names = list(EXPERIMENTS)
    if args.only:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = [n for n in names if n not in EXPERIMENTS]
        if unknown or not names:
            print(
                f"quill bench experiments: error: unknown experiment(s) {unknown}; "
                f"choose from {', '.join(EXPERIMENTS)}",
                file=sys.stderr,
            )
            return 2
        names = [n for n in EXPERIMENTS if n in names]  # always in the document's order
    if not args.price_per_hour > 0:
        print("quill bench experiments: error: --price-per-hour must be positive", file=sys.stderr)
        return 2
    settings = Settings(
        quick=args.quick,
        price_per_hour=args.price_per_hour,
        hardware=args.hardware,
        recalibrate=args.recalibrate,
        kv_cache_memory=args.kv_cache_memory,
        interconnect_bandwidth=args.interconnect,
        model=args.model,
        seed=args.seed,
        progress=not args.no_progress,
    )
    root = default_root()
    doc = args.doc or root / "docs" / "experiments.md"
    out = args.out or root / "docs" / "figures" / "experiments"
    return run_experiments(settings, names, doc, out, command)


if __name__ == "__main__":
    sys.exit(main())
