"""The simulator against the real server over held-out configurations (issue 50's validation).

Each configuration is one run of bench_sim_vs_server.py: its own `quill serve` (model, weight
format, KV format, token budget), its own serving refit (steps the server recorded on workloads
of other seeds, minutes before), then `--repeats` real runs of the held-out workload beside
`quill simulate` on the same arrivals. The table at the end is what the issue's targets are
written against: per configuration the absolute error of TTFT p99, ITL p50 / p99, end-to-end
p99 and output tokens/s, the real runs' own spread, and the medians over configurations.

    .venv/bin/python benchmarks/bench_sim_validation.py --out docs/results/sim_validation
    .venv/bin/python benchmarks/bench_sim_validation.py --only d-fp32-0.3,1b-bf16-0.5

The base calibrations (one per dtype, `quill cost calibrate --quick`) are made first into the
output folder when missing; the 1B configurations use Llama-3.2-1B's real shape with random
weights (benchmarks/real_shapes.py, `--load-format dummy`).
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import bench_sim_vs_server  # noqa: E402
from real_shapes import write_shape  # noqa: E402

from quill.config import cache_dir  # noqa: E402
from quill.cost.calibrate import cpu_info  # noqa: E402
from quill.cost.hardware import HardwareSpec  # noqa: E402
from quill.sim.config import step_ratios_by_kind  # noqa: E402
from quill.sim.speculation import SpecChances  # noqa: E402

# name -> bench_sim_vs_server flags. "1b" ones use Llama-3.2-1B's shape (model made at start).
DEFAULT = "--num-prompts 40 --input-len 128 --output-len 32 "
ONE_B = "--model {1b} --load-format dummy --num-prompts 24 --input-len 48:80 --output-len 16 "
ONE_B += f"--kv-cache-memory {512 << 20} --dtype bfloat16 "
# n-gram drafts (the greedy replies of the default model to random prompts repeat themselves:
# most drafts hold), switched on and off by the cost model as `quill serve` does.
SPEC = '{"method":"ngram","num_speculative_tokens":3,"prompt_lookup_min":2,"prompt_lookup_max":3}'
CONFIGS: dict[str, list[str]] = {
    name: flags.split()
    for name, flags in {
        "d-fp32-0.3": DEFAULT + "--fractions 0.3",
        "d-fp32-0.95": DEFAULT + "--fractions 0.95",
        "d-bf16-0.6": DEFAULT + "--dtype bfloat16 --fractions 0.6",
        "d-int8-0.6": DEFAULT + "--dtype bfloat16 --quantization int8 --fractions 0.6",
        "d-kv-int8-0.6": DEFAULT + "--kv-cache-dtype int8 --fractions 0.6",
        "d-long-budget256-0.6": "--num-prompts 24 --input-len 768:1536 --output-len 32 "
        "--max-num-batched-tokens 256 --fractions 0.6",
        "d-prefix-0.6": "--num-prompts 40 --input-len 512 --output-len 32 --prefix-tokens 384 "
        "--num-prefixes 4 --fractions 0.6",
        "d-seqs8-0.8": "--num-prompts 40 --input-len 128 --output-len 64 --max-num-seqs 8 "
        "--fractions 0.8",
        "d-long-output-0.5": "--num-prompts 32 --input-len 32:96 --output-len 64:160 "
        "--fractions 0.5",
        # A pool of 56 blocks (896 tokens) for up to 16 sequences of 256: requests preempt and
        # recompute.
        "d-preempt-0.7": "--num-prompts 40 --input-len 128 --output-len 128 --max-num-seqs 16 "
        f"--kv-cache-memory {40 << 20} --fractions 0.7",
        "d-spec-0.5": "--num-prompts 40 --input-len 128 --output-len 64 --fractions 0.5 "
        "--speculative-config " + SPEC,
        # Gemma 3 270M as its Q4_K_M GGUF (`make models`), read as stored: K-quant weights,
        # sliding-window layers, a 262k-word head.
        "g3-q4km-0.6": "--model {gguf} --num-prompts 40 --input-len 128 --output-len 32 "
        "--fractions 0.6",
        "1b-bf16-0.5": ONE_B + "--fractions 0.5",
        "1b-bf16-0.9": ONE_B + "--fractions 0.9",
        "1b-int8-0.6": ONE_B + "--quantization int8 --fractions 0.6",
    }.items()
}
GEMMA_GGUF = cache_dir() / "models" / "gemma-3-270m-q4_k_m.gguf"
SCORED = ["ttft_p99", "itl_p50", "itl_p99", "e2e_p99", "tok/s"]
TARGETS = {"e2e_p99": 0.08, "ttft_p99": 0.15, "itl_p50": 0.08, "itl_p99": 0.08, "tok/s": 0.05}


def dtype_of(flags: list[str]) -> str:
    return flags[flags.index("--dtype") + 1] if "--dtype" in flags else "float32"


def base_calibration(out: Path, dtype: str) -> Path:
    """This machine's quick calibration for `dtype` (made once into `out`)."""
    path = out / f"calibration-{dtype}.json"
    if not path.exists():
        print(f"== calibrating {dtype} (quill cost calibrate --quick)", flush=True)
        subprocess.run([sys.executable, "-m", "quill.cli", "cost", "calibrate", "--quick",
                        "--dtype", dtype, "--out", str(path)], check=True)  # fmt: skip
    return path


def errors_of(result: dict, variant: str = "sim") -> dict:
    """A configuration's |error| and real-run spread per scored figure (its one rate)."""
    compare = result["runs"][0]["compare"]
    out = {}
    for key in SCORED:
        row = compare.get(key)
        if row and variant in row and row[variant]["error"] is not None:
            out[key] = {"error": row[variant]["error"], "spread": row["spread"]}
    return out


def resimulate(result: dict) -> dict:
    """The result's real runs against the simulator as it is now (each variant), on the same
    arrivals and the same serving refit: a change to the simulator judged without new runs."""
    settings = result["settings"]
    chances = result.get("spec_chances")
    hardware = HardwareSpec.from_dict(result["simulated_with"])
    config = bench_sim_vs_server.sim_config(
        settings,
        hardware,
        result["front_latency_s"],
        None if chances is None else SpecChances(**chances),
    )
    for row in result["runs"]:
        items = bench_sim_vs_server.workload_of(settings, row["rate"], settings["seed"])
        sims = bench_sim_vs_server.variants(config, step_ratios_by_kind(hardware))
        seeds = settings.get("sim_seeds", bench_sim_vs_server.SIM_SEEDS)
        simulated = {n: bench_sim_vs_server.simulate(c, items, seeds) for n, c in sims.items()}
        row["simulated"] = simulated
        row["compare"] = bench_sim_vs_server.compare(row["server"], simulated)
    return result


STEADY = 0.05  # a run "held the fit's speed" when its steps took within 5% of the fit's


def steady(result: dict) -> bool:
    """Whether both real runs' steps took within STEADY of the fitted steps' time against the
    same model (`run_speeds`): the machine held its speed from the fit to the runs, so what is
    left of the error is the simulator's (this VM's speed states move it by up to 1.4x)."""
    speeds = result["runs"][0].get("run_speeds")
    return bool(speeds) and all(abs(s - 1) <= STEADY for s in speeds)


def medians(results: dict[str, dict]) -> dict:
    """Per scored figure: the median |error| over the configurations, with the target and
    the worst error beyond the real runs' spread."""
    summary = {}
    for key in SCORED:
        errs = [abs(r[key]["error"]) for r in results.values() if key in r]
        beyond = [abs(r[key]["error"]) - r[key]["spread"] for r in results.values() if key in r]
        if errs:
            summary[key] = {"median_abs_error": statistics.median(errs),
                            "target": TARGETS[key],
                            "worst_beyond_spread": max(beyond)}  # fmt: skip
    return summary


def table(results: dict[str, dict], held: set[str] = frozenset()) -> dict:
    """Print each configuration's errors (the real runs' spread in brackets; * where the runs
    held the fit's speed) and their medians, over all and over the `held` ones; returns the
    medians with the targets (the held ones' under "steady")."""
    print(f"\n{'configuration':32}" + "".join(f"{k:>16}" for k in SCORED))
    for name, errs in results.items():
        cells = "".join(
            f"{errs[k]['error']:+8.1%} ({errs[k]['spread']:4.0%})" if k in errs else f"{'-':>16}"
            for k in SCORED
        )
        print(f"{name + (' *' if name in held else ''):32}{cells}")
    summary = medians(results)
    kept = {n: r for n, r in results.items() if n in held}
    lines = [("median |error|", summary)]
    if kept:
        summary["steady"] = {"configurations": sorted(kept), **medians(kept)}
        lines.append((f"median, * ({len(kept)})", summary["steady"]))
    for label, figures in lines:
        print(f"{label:32}" + "".join(
            f"{figures[k]['median_abs_error']:16.1%}" if k in figures else f"{'-':>16}"
            for k in SCORED))  # fmt: skip
    print(f"{'target':32}" + "".join(f"{TARGETS[k]:16.0%}" for k in SCORED))
    return summary


VARIANTS = ("sim", "sim-independent", "sim-by-kind", "sim-jitter-off")


def variant_tables(saved: dict[str, dict]) -> dict[str, dict]:
    """Each variant's table over the saved results (name -> result), the configurations whose
    runs held the fit's speed marked; returns each variant's medians."""
    held = {n for n, r in saved.items() if steady(r)}
    summary = {}
    for variant in VARIANTS:
        errors = {n: e for n, r in saved.items() if (e := errors_of(r, variant))}
        if errors:
            if variant != "sim":
                print(f"\n{variant}:")
            summary[variant] = table(errors, held)
    return summary


def pooled(folders: list[Path]) -> int:
    """The tables over every saved result of `folders` (as each was last simulated): two
    validation runs of the same configurations on other days pool their evidence."""
    variant_tables({f"{folder.name}/{path.stem}": json.loads(path.read_text())
                    for folder in folders for name in CONFIGS
                    if (path := folder / f"{name}.json").exists()})  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default="docs/results/sim_validation", help="folder for the results")
    p.add_argument("--only", help="comma-separated configuration names")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument(
        "--resimulate",
        action="store_true",
        help="no server: simulate the saved results' workloads again (the simulator as it is "
        "now, each variant) against their real runs",
    )
    p.add_argument(
        "--pool",
        metavar="FOLDERS",
        help="no server, no simulation: the medians over the saved results of these folders "
        "(comma-separated) together, each configuration of each folder one entry",
    )
    args = p.parse_args(argv)
    if args.pool:
        return pooled([Path(f) for f in args.pool.split(",")])
    # A SIGTERM unwinds like Ctrl-C, so that the running configuration's server is stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only.split(",") if args.only else list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configurations {unknown}; known: {', '.join(CONFIGS)}")
    model_1b = write_shape("llama-3.2-1b", cache_dir() / "real-shapes" / "llama-3.2-1b")
    for name in names if args.resimulate else []:
        path = out / f"{name}.json"
        if path.exists():
            path.write_text(json.dumps(resimulate(json.loads(path.read_text())), indent=1))
    for name in [] if args.resimulate else names:
        flags = [f.replace("{1b}", str(model_1b)).replace("{gguf}", str(GEMMA_GGUF))
                 for f in CONFIGS[name]]  # fmt: skip
        hardware = base_calibration(out, dtype_of(flags))
        path = out / f"{name}.json"
        print(f"\n== {name}: {' '.join(flags)}", flush=True)
        started = time.monotonic()
        bench_sim_vs_server.main([*flags, "--hardware", str(hardware), "--repeats",
                                  str(args.repeats), "--json", str(path)])  # fmt: skip
        print(f"== {name}: {time.monotonic() - started:.0f} s", flush=True)
    # Every configuration with a result in the folder (those not run now: from earlier runs,
    # each self-contained: its own server, refit and real runs).
    saved = {name: json.loads(path.read_text())
             for name in CONFIGS if (path := out / f"{name}.json").exists()}  # fmt: skip
    results = {name: errors_of(result) for name, result in saved.items()}
    summary = variant_tables(saved)
    (out / "summary.json").write_text(json.dumps({
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "machine": cpu_info(),
        "configurations": {n: CONFIGS[n] for n in results},
        "run_now": names,
        "errors": results,
        "summary": summary,
    }, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
