"""`quill simulate`: serve a workload in virtual time with the engine's own scheduler.

The command answers capacity questions before any hardware is bought or model downloaded:
latency percentiles and throughput for a request stream, the highest rate one replica
sustains within an SLO, and whether splitting prefill from decode pays. Everything it needs
(cost model, engine core) is torch-free, so it runs anywhere in seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from contextlib import contextmanager
from dataclasses import replace

from quill import argtypes
from quill.config import SpeculativeConfig
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec, bytes_per_element, kv_bytes_per_element
from quill.engine_args import add_scheduler_arguments
from quill.sim.capacity import find_capacity, meets, replicas_needed
from quill.sim.cluster import ROUTERS, run_colocated, run_disaggregated
from quill.sim.config import SimConfig, model_context_len
from quill.sim.help import DESCRIPTION, EPILOG
from quill.sim.metrics import SLO
from quill.sim.report import format_capacity, format_comparison, format_run
from quill.sim.speculation import SpecChances
from quill.sim.workload import LengthSpec, read_trace, synthetic


def _split(text: str) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    try:
        counts = int(p), int(d)
    except ValueError:
        raise ValueError(f"expected P:D (two replica counts), got {text!r}") from None
    if not sep or min(counts) < 1:
        raise ValueError(f"expected P:D with P, D >= 1, got {text!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default="SmolLM2-135M", help="preset, HF dir, config.json, .gguf"
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="weights (auto: the config's torch_dtype; presets are bfloat16); the KV cache is "
        "--kv-cache-dtype's",
    )
    parser.add_argument(
        "--hardware",
        default="H100-SXM",
        help="preset (H100-SXM, H200, A100-80GB-SXM, L40S) "
        "or a hardware JSON such as `quill cost calibrate` writes",
    )
    parser.add_argument(
        "--tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="tensor-parallel ranks per replica (on a hardware file with a measured all-reduce "
        "for this many ranks, they share that one host, as `quill serve -tp` runs them)",
    )
    parser.add_argument("--replicas", type=int, default=1, help="colocated replicas")
    parser.add_argument(
        "--router",
        default="least-work",
        choices=ROUTERS,
        help="least-work: fewest tokens held (an oracle); round-robin: in turn; least-load "
        "and cache-aware: quill router's policies, on the replicas' queues polled every "
        "0.25 s and their KV-cache events 0.3 s late",
    )
    work = parser.add_argument_group("workload")
    work.add_argument("--num-requests", type=int, default=None, help="default 1000 (trace: all)")
    work.add_argument(
        "--request-rate",
        type=argtypes.checked(argtypes.rate, "request rate"),
        default=math.inf,
        help="requests per second (default inf: all at t=0)",
    )
    work.add_argument(
        "--burstiness",
        type=argtypes.checked(argtypes.positive, "burstiness"),
        default=1.0,
        help="gamma shape of inter-arrival times (1: Poisson; <1: burstier)",
    )
    work.add_argument(
        "--prompt-tokens",
        type=argtypes.checked(LengthSpec.parse, "prompt tokens"),
        default=LengthSpec(256, 256),
        help="N or MIN:MAX (uniform)",
    )
    work.add_argument(
        "--output-tokens",
        type=argtypes.checked(LengthSpec.parse, "output tokens"),
        default=LengthSpec(128, 128),
        help="N or MIN:MAX (uniform)",
    )
    work.add_argument(
        "--prefix-tokens",
        type=int,
        default=None,
        metavar="N",
        help="each prompt's first N tokens are shared with other requests (see below)",
    )
    work.add_argument(
        "--num-prefixes",
        type=int,
        default=None,
        metavar="K",
        help="distinct shared prefixes, used in turn (default 1; needs --prefix-tokens)",
    )
    work.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="JSONL requests (see below), instead of the rate and length flags",
    )
    work.add_argument("--seed", type=int, default=0)
    sched_jitter = parser.add_argument_group("step times")
    sched_jitter.add_argument(
        "--front-latency",
        type=float,
        default=0.0,
        metavar="MS",
        help="time outside the engine before a first token (the request's way in and the "
        "token's way out: a client's TTFT minus the server's own), added to every TTFT and "
        "end-to-end latency (default 0: the engine's view)",
    )
    sched_jitter.add_argument(
        "--step-jitter",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="multiply each step's price by a ratio drawn from those the hardware file's "
        "calibration measured (measured / predicted; a serving calibration's hold a serving "
        "engine's scatter): the spread that makes tails (default: on, where the file has them)",
    )
    sched_jitter.add_argument(
        "--step-jitter-by-kind",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="draw each kind of step (decode, prefill, mixed) from its own measured ratios "
        "where the file has them, not all steps' (default: off)",
    )
    sched_jitter.add_argument(
        "--step-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="draw each step's ratio with the memory the calibration measured (slow steps "
        "come in patches lasting about its `seconds`, as on a shared host), not "
        "independently (default: on, where the file has it)",
    )
    sched_jitter.add_argument(
        "--fast-forward",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="run steady decode steps (all decoding, nothing waiting or ending) many at once "
        "instead of one by one through the engine core: the same results, several times "
        "faster (default: on; off to check that)",
    )
    sched = parser.add_argument_group("engine")
    add_scheduler_arguments(sched)
    sched.add_argument("--max-model-len", type=int, default=None)
    spec = parser.add_argument_group("speculative decoding (drafts drawn with measured chances)")
    spec.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="as quill serve's (n-gram drafts; by_cost: the switch decides, as on a server)",
    )
    spec.add_argument(
        "--spec-acceptance",
        type=float,
        default=0.6,
        metavar="P",
        help="P(a draft holds | the ones before it held); a server's counters give it "
        "(SpecChances.measured) (default 0.6)",
    )
    spec.add_argument(
        "--spec-proposal-rate",
        type=float,
        default=1.0,
        metavar="P",
        help="share of decodes the proposer finds drafts for (default 1)",
    )
    spec.add_argument(
        "--spec-draft-length",
        type=float,
        default=None,
        metavar="N",
        help="mean drafts a proposal holds (default: all allowed)",
    )
    modes = parser.add_argument_group("objectives and modes")
    modes.add_argument(
        "--slo",
        type=argtypes.checked(SLO.parse, "slo"),
        default=None,
        metavar="ttft=MS,itl=MS[,e2e=MS]",
    )
    modes.add_argument("--capacity", action="store_true", help="search the sustainable rate")
    modes.add_argument(
        "--capacity-tolerance",
        type=argtypes.checked(argtypes.positive, "tolerance"),
        default=0.02,
        help="relative gap between passing and failing rates (default 0.02)",
    )
    modes.add_argument(
        "--target-rate",
        type=argtypes.checked(argtypes.positive, "target rate"),
        default=None,
        help="with --capacity: replicas needed for this many requests/s",
    )
    modes.add_argument(
        "--disaggregate",
        type=argtypes.checked(_split, "disaggregate"),
        default=None,
        metavar="P:D",
        help="compare P prefill + D decode replicas",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="one JSON object on stdout")
    out.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def add_simulate_parser(subparsers) -> argparse.ArgumentParser:
    """Register `simulate` on the `quill` command's subparsers."""
    parser = subparsers.add_parser(
        "simulate",
        help="serve a workload in virtual time with the cost model",
        description=DESCRIPTION,
        epilog=EPILOG,
        usage="quill simulate [options]   (--help lists them)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    parser.set_defaults(func=run_simulate)
    return parser


def run_simulate(args: argparse.Namespace) -> int:
    """Run the command; a bad setting is one line on stderr and exit status 2."""
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        print(f"quill simulate: error: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    config, settings, workload, slo = _setup(args)
    progress = sys.stderr.isatty() if args.progress is None else args.progress
    total = settings["workload"]["num_requests"]
    if args.capacity:
        output = _capacity(args, config, settings, workload, slo, progress)
    elif args.disaggregate:
        p, d = args.disaggregate
        with _bar(progress, total, f"colocated x{p + d}") as bar:
            colocated = run_colocated(config, workload(), p + d, slo, args.router, bar)
        with _bar(progress, total, f"disaggregated {p}:{d}") as bar:
            split = run_disaggregated(config, workload(), p, d, slo, args.router, bar)
        output = {"colocated": colocated, "disaggregated": split}
    else:
        with _bar(progress, total, "simulating") as bar:
            output = run_colocated(config, workload(), args.replicas, slo, args.router, bar)
    if args.json:
        print(json.dumps(_jsonable({"settings": settings, **output})))
    elif args.capacity:
        print(format_capacity(settings, output["capacity"], output.get("replicas_for_target")))
    elif args.disaggregate:
        print(format_comparison(settings, output["colocated"], output["disaggregated"]))
    else:
        print(format_run(settings, output))
    sys.stdout.flush()
    wall = time.perf_counter() - started
    print(f"quill simulate: done in {wall:.1f} s of wall time", file=sys.stderr)
    return 0


def _setup(args: argparse.Namespace):
    for flag, value in (("--tp", args.tp), ("--replicas", args.replicas)):
        if value < 1:
            raise ValueError(f"{flag} must be at least 1, got {value}")
    if args.num_requests is not None and args.num_requests < 1:
        raise ValueError(f"--num-requests must be at least 1, got {args.num_requests}")
    if args.capacity and args.disaggregate:
        raise ValueError("--capacity and --disaggregate cannot be combined")
    if args.replicas != 1 and (args.capacity or args.disaggregate):
        raise ValueError(
            "--replicas does not combine with --capacity (one replica's rate) or --disaggregate "
            "(which compares P+D colocated replicas)"
        )
    if args.target_rate is not None and not args.capacity:
        raise ValueError("--target-rate needs --capacity")
    if args.capacity and (args.slo is None or args.slo.ttft is None or args.slo.itl is None):
        raise ValueError("--capacity needs --slo with ttft and itl, e.g. --slo ttft=500,itl=50")
    if args.capacity and args.trace:
        raise ValueError("--capacity scales a synthetic workload's rate; it cannot use --trace")
    if args.prefix_tokens is not None and args.prefix_tokens < 1:
        raise ValueError(f"--prefix-tokens must be at least 1, got {args.prefix_tokens}")
    if args.num_prefixes is not None and args.num_prefixes < 1:
        raise ValueError(f"--num-prefixes must be at least 1, got {args.num_prefixes}")
    if args.num_prefixes is not None and args.prefix_tokens is None:
        raise ValueError("--num-prefixes needs --prefix-tokens")
    if args.trace and args.prefix_tokens is not None:
        raise ValueError("--prefix-tokens is for a synthetic workload; a trace names its prefixes")
    if args.capacity_tolerance >= 1:
        raise ValueError(f"--capacity-tolerance must be below 1, got {args.capacity_tolerance}")
    bytes_per_param = None if args.dtype == "auto" else bytes_per_element(args.dtype)
    model = ModelSpec.resolve(args.model, bytes_per_param)
    model.kv_bytes_per_element = kv_bytes_per_element(args.kv_cache_dtype, args.dtype)
    hardware = HardwareSpec.resolve(args.hardware)
    if args.disaggregate and hardware.interconnect_bandwidth is None:
        raise ValueError(f"--disaggregate needs the interconnect bandwidth of {hardware.name}")
    config = SimConfig.create(
        model,
        hardware,
        args.tp,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        context_len=model_context_len(args.model, model),
        enable_prefix_caching=args.enable_prefix_caching,
        step_jitter=args.step_jitter,
        jitter_by_kind=args.step_jitter_by_kind,
        seed=args.seed,
    )
    if args.front_latency < 0:
        raise ValueError(f"--front-latency must be at least 0, got {args.front_latency}")
    config = replace(
        config, front_latency_s=args.front_latency / 1000, fast_forward=args.fast_forward
    )
    if not args.step_memory:
        config = replace(config, step_memory=None)
    if args.speculative_config is not None:
        chances = SpecChances(args.spec_proposal_rate, args.spec_draft_length, args.spec_acceptance)
        spec = SpeculativeConfig.parse(args.speculative_config)
        config = replace(config, speculative=spec, spec_chances=chances)
    if args.trace:
        items = read_trace(args.trace, args.num_requests, check=config.check_request)
        if not items:
            raise ValueError(f"trace {args.trace} holds no request")

        def workload(rate=None):
            return iter(items)

        workload_settings = {"trace": args.trace, "num_requests": len(items)}
    else:
        num = args.num_requests or 1000
        reason = config.check_request(args.prompt_tokens.high, args.output_tokens.high)
        if reason is not None:
            raise ValueError(f"--prompt-tokens/--output-tokens: {reason}")

        prefix_tokens = args.prefix_tokens or 0
        num_prefixes = args.num_prefixes or 1

        def workload(rate=args.request_rate, num=num):
            return synthetic(
                num,
                rate,
                args.prompt_tokens,
                args.output_tokens,
                args.burstiness,
                args.seed,
                prefix_tokens=prefix_tokens,
                num_prefixes=num_prefixes,
            )

        workload_settings = {
            "trace": None,
            "num_requests": num,
            "request_rate": None if args.capacity else args.request_rate,
            "burstiness": args.burstiness,
            "prompt_tokens": str(args.prompt_tokens),
            "output_tokens": str(args.output_tokens),
            "seed": args.seed,
            "prefix_tokens": args.prefix_tokens,
            "num_prefixes": num_prefixes if args.prefix_tokens else None,
        }
    settings = {
        "mode": "capacity" if args.capacity else "disaggregate" if args.disaggregate else "run",
        "model_arg": args.model,
        "dtype": model.dtype,
        "hardware_arg": args.hardware,
        "scheduler": config.to_dict(),
        "replicas": args.replicas,
        "router": args.router,
        "workload": workload_settings,
        "slo": args.slo.to_dict() if args.slo else None,
        "disaggregate": list(args.disaggregate) if args.disaggregate else None,
        "capacity_tolerance": args.capacity_tolerance if args.capacity else None,
        "target_rate": args.target_rate,
    }
    return config, settings, workload, args.slo


def _capacity(args, config: SimConfig, settings: dict, workload, slo: SLO, progress: bool):
    num = settings["workload"]["num_requests"]

    def run_at(rate: float) -> dict:
        with _bar(progress, num, f"rate {rate:.4g}/s") as bar:
            return run_colocated(config, workload(rate), 1, slo, args.router, bar)

    found = find_capacity(run_at, slo, args.capacity_tolerance)
    output = {"capacity": found}
    if args.target_rate is not None:
        n = replicas_needed(args.target_rate, found["capacity_rate"])
        # Each replica sees about `num` requests, as in the search's trials.
        with _bar(progress, num * n, f"check x{n}") as bar:
            check = run_colocated(
                config, workload(args.target_rate, num * n), n, slo, args.router, bar
            )
        price = config.cost.hardware.price_per_hour
        output["replicas_for_target"] = {
            "target_rate": args.target_rate,
            "replicas": n,
            "devices": n * config.cost.tp,
            "assumption": "the target rate splits evenly over independent replicas",
            "check": check,
            "check_meets_slo": meets(slo, check["results"]),
            "cost_per_hour": None if price is None else price * n * config.cost.tp,
        }
    return output


@contextmanager
def _bar(enabled: bool, total: int, desc: str):
    if not enabled:
        yield None
        return
    from tqdm import tqdm

    with tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False) as bar:
        yield bar.update


def _jsonable(value):
    """JSON has no infinity: an infinite rate is written as the string "inf"."""
    if isinstance(value, float) and math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items() if not k.startswith("_")}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    """`quill simulate` on its own: `python -m quill.sim.cli [options]`."""
    parser = argparse.ArgumentParser(prog="quill")
    sub = parser.add_subparsers(dest="command", required=True)
    add_simulate_parser(sub)
    try:
        args = parser.parse_args(["simulate", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as e:  # argparse has printed its message
        return int(e.code or 0)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
