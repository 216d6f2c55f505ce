"""`quill cost`: what serving a model costs on a device, worked out without running it.

The command turns flags into a ModelSpec, a HardwareSpec and request shapes, prices them with
the roofline cost model and prints the table (or JSON, or a roofline plot). Everything a user
can get wrong ends in one clear line and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import re
import sys
from dataclasses import asdict

from quill.cost.hardware import PRESETS as HARDWARE_PRESETS
from quill.cost.hardware import HardwareSpec
from quill.cost.model import PRESETS as MODEL_PRESETS
from quill.cost.model import ModelSpec, kv_bytes_per_element
from quill.cost.step import CostModel
from quill.cost.table import build_rows, format_costs, format_header, format_rows, price_costs

DESCRIPTION = """\
Price prompts and replies with the roofline cost model: a pass takes the longer of its
arithmetic (FLOPs / peak FLOP/s) and its movement (weights + KV cache + activations / memory
bandwidth). For each prompt length l, reply length o and batch B it prints a prefill row (B
prompts of l tokens in one pass; its time is the wait for the first token, TTFT) and a decode
row (o passes of B sequences, contexts l .. l+o-1; time per pass is the inter-token latency).

Give a model (--model, or --params with --bytes-per-param) and hardware (--hardware, or
--flops with --bandwidth). `quill cost calibrate ...` fits a hardware file on this machine.
"""

EPILOG = f"""\
model presets: {", ".join(MODEL_PRESETS)}
hardware presets: {", ".join(HARDWARE_PRESETS)}
numbers take SI suffixes: 312T, 3.35T, 80G, 80GiB, 7B (params: B = billion)

examples:
  quill cost --model Llama-3-8B --hardware H100-SXM --batch 1,64 --price-per-hour 2.5
  quill cost --params 7e9 --bytes-per-param 2 --flops 989T --bandwidth 3.35T --json
  quill cost --model Llama-3-70B --hardware h100 --tp 4 --plot roofline.png
"""


def add_cost_parser(subparsers) -> argparse.ArgumentParser:
    """Register `cost` on the top-level `quill` sub-commands."""
    parser = subparsers.add_parser(
        "cost",
        help="what serving a model costs on given hardware (roofline model)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    return parser


def _configure(parser: argparse.ArgumentParser) -> None:
    # Values stay strings here and are parsed in run_cost, so a bad value gets our one-line
    # error (argparse's own would print the usage block first).
    model = parser.add_argument_group("model (one of)")
    model.add_argument("--model", metavar="PATH|PRESET", help="HF dir, config.json, .gguf")
    model.add_argument("--params", metavar="N", help="abstract model of N parameters (weights)")
    model.add_argument(
        "--bytes-per-param",
        metavar="N",
        help="bytes per weight (default: 2 for --params; the config's dtype for --model)",
    )
    model.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="how the KV cache is stored: auto (16-bit, as quill serves it) | float32 | "
        "bfloat16 | float16 | int8, or K,V apart",
    )
    hw = parser.add_argument_group("hardware (one of)")
    hw.add_argument("--hardware", metavar="PRESET|FILE", help="a preset or a JSON spec")
    hw.add_argument("--flops", metavar="N", help="abstract hardware: peak FLOP/s")
    hw.add_argument("--bandwidth", metavar="N", help="abstract hardware: memory bytes/s")
    hw.add_argument(
        "--memory", metavar="N", help="abstract hardware: memory bytes (default: unlimited)"
    )
    load = parser.add_argument_group("requests")
    load.add_argument("--prompt-tokens", default="512", metavar="N[,N...]", help="default 512")
    load.add_argument("--output-tokens", default="128", metavar="N[,N...]", help="default 128")
    load.add_argument("--batch", default="1,32", metavar="B[,B...]", help="default 1,32")
    load.add_argument("--tp", default="1", metavar="N", help="tensor-parallel devices (default 1)")
    out = parser.add_argument_group("output")
    out.add_argument(
        "--price-per-hour",
        metavar="USD",
        help="per device; adds $ per million prompt/reply tokens, quiet vs busy",
    )
    out.add_argument("--json", action="store_true", help="one JSON document instead of tables")
    out.add_argument("--plot", metavar="FILE.png", help="write the roofline with each row on it")
    # `quill cost calibrate ARGS...` hands ARGS untouched to quill.cost.calibrate.main; its
    # parser reads no option prefixes so flags like --model reach calibrate as they are.
    actions = parser.add_subparsers(
        dest="cost_action", title="actions", metavar="calibrate", required=False
    )
    calibrate = actions.add_parser(
        "calibrate",
        help="fit this machine's coefficients into a hardware file",
        add_help=False,
        prefix_chars="\0",
    )
    calibrate.add_argument("calibrate_args", nargs="*")
    parser.set_defaults(func=run_cost)


def main(argv: list[str] | None = None) -> int:
    """`quill cost` on its own (also `python -m quill.cost.cli`)."""
    parser = argparse.ArgumentParser(
        prog="quill cost",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _configure(parser)
    return run_cost(parser.parse_args(argv))


def run_cost(args: argparse.Namespace) -> int:
    if getattr(args, "cost_action", None) == "calibrate":
        return _run_calibrate(args.calibrate_args)
    try:
        return _run(args)
    except (ValueError, OSError) as e:
        message = " ".join(str(e).split())  # one line, whatever the exception held
        print(f"quill cost: error: {message}", file=sys.stderr)
        return 2


def _run_calibrate(rest: list[str]) -> int:
    # Imported only when asked for: calibrating needs torch, pricing does not.
    calibrate = importlib.import_module("quill.cost.calibrate")
    return calibrate.main(rest) or 0


def _run(args: argparse.Namespace) -> int:
    model = _model(args)
    hardware = _hardware(args, model)
    tp = _count(args.tp, "--tp")
    prompts = _counts(args.prompt_tokens, "--prompt-tokens")
    outputs = _counts(args.output_tokens, "--output-tokens")
    batches = _counts(args.batch, "--batch")
    price = hardware.price_per_hour
    if args.price_per_hour is not None:
        price = _positive(args.price_per_hour, "--price-per-hour", suffixes=False)

    cm = CostModel(model, hardware, tp)
    capacity = cm.kv_capacity_tokens()  # raises when the weights alone do not fit
    rows = build_rows(cm, prompts, outputs, batches)
    costs = price_costs(cm, prompts, outputs, price) if price is not None else None
    if args.plot:
        from quill.cost.plot import plot_roofline

        plot_roofline(cm, rows, args.plot)

    if args.json:
        doc = {
            "model": {**asdict(model), "weight_bytes": model.weight_bytes},
            "hardware": hardware.to_dict(),
            "tp": tp,
            "peak_flops": cm.peak_flops,
            "ridge_ops_per_byte": cm.ridge_ops_per_byte,
            "kv_capacity_tokens": capacity,
            "rows": [r.as_dict() for r in rows],
        }
        if costs is not None:
            doc["costs"] = costs
        print(json.dumps(_finite(doc), indent=2, allow_nan=False))
        return 0
    print(format_header(cm))
    print()
    print(format_rows(rows))
    if costs is not None:
        print()
        print(format_costs(costs))
    if args.plot:
        print(f"\nroofline plot written to {args.plot}")
    return 0


def _model(args: argparse.Namespace) -> ModelSpec:
    if args.model is not None and args.params is not None:
        raise ValueError("give --model or --params, not both")
    bpp = None
    if args.bytes_per_param is not None:
        bpp = _positive(args.bytes_per_param, "--bytes-per-param", suffixes=False)
    if args.model is not None:
        model = ModelSpec.resolve(args.model, bpp)
        model.kv_bytes_per_element = kv_bytes_per_element(args.kv_cache_dtype)
        return model
    if args.params is not None:
        return ModelSpec.abstract(_positive(args.params, "--params", counts=True), bpp or 2)
    raise ValueError("give a model: --model PATH|PRESET, or --params N [--bytes-per-param N]")


def _hardware(args: argparse.Namespace, model: ModelSpec) -> HardwareSpec:
    abstract = [f for f in ("flops", "bandwidth", "memory") if getattr(args, f) is not None]
    if args.hardware is not None:
        if abstract:
            raise ValueError(f"give --hardware or --{abstract[0]}, not both")
        return HardwareSpec.resolve(args.hardware)
    if not abstract:
        raise ValueError("give hardware: --hardware PRESET|FILE, or --flops N --bandwidth N")
    for flag in ("flops", "bandwidth"):
        if getattr(args, flag) is None:
            raise ValueError(
                f"abstract hardware needs --flops and --bandwidth; --{flag} is missing"
            )
    memory = math.inf if args.memory is None else _positive(args.memory, "--memory")
    return HardwareSpec(
        name="abstract",
        flops={model.dtype: _positive(args.flops, "--flops")},
        memory_bandwidth=_positive(args.bandwidth, "--bandwidth"),
        memory_capacity=memory,
    )


# -- numbers -------------------------------------------------------------------------------
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SI = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
_BINARY = {"ki": 2.0**10, "mi": 2.0**20, "gi": 2.0**30, "ti": 2.0**40}
_COUNTS = {"": 1.0, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}


def _positive(text: str, flag: str, suffixes: bool = True, counts: bool = False) -> float:
    """A positive finite number: '1e12', '312T', '3.35TB/s', '80GiB'; for counts '7B'."""
    s = str(text).strip()
    if counts:
        m = re.fullmatch(_NUMBER + r"\s*([kKmMbBgGtT]?)", s)
        scale = _COUNTS[m.group(2).lower()] if m else None
    elif suffixes:
        unit = r"\s*(?:B/s|B|bytes|FLOP/s|FLOPS|flop/s|flops)?"
        m = re.fullmatch(_NUMBER + r"\s*((?:[kKmMgGtT]i)|[kKmMgGtTpP])?" + unit, s)
        suffix = (m.group(2) or "").lower() if m else ""
        scale = _BINARY.get(suffix) or _SI.get(suffix)
    else:
        m = re.fullmatch(_NUMBER, s)
        scale = 1.0
    if not m:
        raise ValueError(f"{flag} expects a number like 1e12 or 312T, got {text!r}")
    value = float(m.group(1)) * scale
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{flag} must be positive, got {text!r}")
    return value


def _count(text: str, flag: str) -> int:
    s = str(text).strip()
    if not s.isdigit() or int(s) < 1:
        raise ValueError(f"{flag} expects a positive integer, got {text!r}")
    return int(s)


def _counts(text: str, flag: str) -> list[int]:
    parts = str(text).split(",")
    if any(not p.strip() for p in parts):
        raise ValueError(f"{flag} expects N[,N...], got {text!r}")
    return [_count(p, flag) for p in parts]


def _finite(value):
    """JSON has no Infinity: unlimited quantities are written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
