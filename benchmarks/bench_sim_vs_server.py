"""The simulator against the real server: the same Poisson workload, three rates up to saturation.

The simulator is only worth planning with if, for the machine it was calibrated on, it predicts
what a client of the real server sees. This starts `quill serve` (same scheduler settings, the
calibrated hardware spec), sends the same workload to it (streaming, one chunk per token,
timestamped on arrival) and to `quill simulate`'s engine loop in virtual time, and compares
TTFT, inter-token and end-to-end latency at p50, p90 and p99 and output tokens/s, each error
beside the spread of `--repeats` real runs of the same arrivals; simulated with the
calibration's step-time jitter (quill/sim/jitter.py) and without it.

On a small machine the engine shares its cores with the HTTP side and the client, and its steps
run slower than they did alone when the machine was calibrated. So by default the step model
is first refitted on steps the server itself recorded under load, from workloads of other
seeds (a Poisson stream and a burst; `quill cost calibrate --from-steps`), keeping the
calibration's measured rates; with `--no-serving-calibration` the simulator uses the
calibration as it is.

    .venv/bin/python benchmarks/bench_sim_vs_server.py --hardware FILE --json out.json

Any model quill serves (`--model DIR`, `--load-format dummy` for random weights of a real
shape, or a .gguf file), weight and KV formats (`--dtype`, `--quantization`,
`--kv-cache-dtype`), token budget, shared prefixes (`--prefix-tokens`, `--num-prefixes`) and
speculative decoding (`--speculative-config`: the simulator draws its drafts with the chances
the server's counters gave during the refit); each real run also reports its preemptions,
prefix-cache hit rate and draft acceptance from the server's counters, beside the simulator's,
and how much slower its steps were than the fitted steps against the same model (the
machine's speed moving between the fit and the run: benchmarks/probe_machine_speed.py).
benchmarks/bench_sim_validation.py runs it over the held-out configurations.

The simulator's figure is the mean over `--sim-seeds` runs of the same arrivals with other
seeds of its draws (the step jitter, drafts): with a few dozen requests a p99 is nearly the
slowest request, and one seeded run of the simulator scatters as much as one real run does.
The seeds' own spread is kept beside it (`seed_spread`).

Rates: the simulator's saturated throughput (every request at once) sets the top one; the other
two are fractions of it (`--fractions`, default 0.3, 0.6, 0.9: exactly at saturation a queue
grows without bound in both, and any error in the service rate is multiplied many times).
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import json
import math
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx

from quill.bench.client import random_prompt, run_workload, summarize
from quill.config import SpeculativeConfig
from quill.cost.batch import BatchShape
from quill.cost.calibrate import cpu_info
from quill.cost.hardware import HardwareSpec
from quill.cost.live import find_calibration_file
from quill.cost.model import ModelSpec, bytes_per_element, kv_bytes_per_element
from quill.cost.refit import recorded_steps, refit_spec, step_gaps
from quill.cost.step import CostModel
from quill.engine.record import read_steps
from quill.sim.cluster import run_colocated
from quill.sim.config import SimConfig, step_ratios_by_kind
from quill.sim.speculation import SpecChances
from quill.sim.workload import LengthSpec, synthetic

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """`quill serve` in a subprocess on a free port; its ready line tells the URL."""

    def __init__(self, flags: list[str]) -> None:
        cmd = [sys.executable, "-m", "quill.cli", "serve", "--port", "0", "--no-access-log"]
        self.proc = subprocess.Popen(
            cmd + flags,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.url = None
        deadline = time.monotonic() + 300
        for line in self.proc.stdout:
            match = re.search(r"at (http://\S+) \(OpenAI", line)
            if match:
                self.url = match.group(1)
            if "ready" in line and self.url:
                break
            if time.monotonic() > deadline:
                break
        if self.url is None:
            self.stop()
            raise SystemExit("the server did not start")
        # Keep reading its output so that the pipe never fills and blocks it.
        threading.Thread(target=self.proc.stdout.read, daemon=True).start()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def variants(config: SimConfig, by_kind: dict | None = None) -> dict[str, SimConfig]:
    """The simulator as configured ("sim": draws from all steps' ratios, with the measured
    memory), with independent draws, with each kind of step drawing from its own ratios
    (`by_kind`, the calibration's), and without draws."""
    out = {"sim": config}
    if config.step_memory is not None:
        out["sim-independent"] = replace(config, step_memory=None)
    if by_kind:
        out["sim-by-kind"] = replace(config, step_jitter_by_kind=by_kind)
    if config.step_jitter is not None or config.step_jitter_by_kind:
        out["sim-jitter-off"] = replace(config, step_jitter=None, step_jitter_by_kind=None)
    return out


def run_speeds(checks: list[dict], fitted: dict | None) -> list[float] | None:
    """How much slower each real run's steps were than the steps the model was fitted on,
    both against the fitted model (measured / predicted busy time, over the fitted steps'
    own): the machine's speed moving between the fit and the runs (a shared VM's can, by a
    third: benchmarks/probe_machine_speed.py). None without both."""
    if not fitted or not fitted.get("busy_ratio"):
        return None
    return [fitted["busy_ratio"] / c["busy_ratio"] for c in checks if c.get("busy_ratio")]


def model_path(settings: dict) -> str:
    from quill.model.default_model import default_model_dir

    return settings["model"] or str(default_model_dir())


def sim_config(
    settings: dict, hardware: HardwareSpec, front: float = 0.0, chances: SpecChances | None = None
) -> SimConfig:
    """The simulated replica for the benchmark's settings (its flags, as a dict) on `hardware`
    (its jitter and gaps too, where it has them), `front` seconds outside the engine; with
    speculation, its drafts drawn with `chances` (measured on the server)."""
    dtype = settings["dtype"]
    path = model_path(settings)
    # A GGUF's weights are read as stored: the file says their bytes.
    per_param = None if path.endswith(".gguf") else bytes_per_element(dtype)
    model = ModelSpec.from_path(path, bytes_per_param=per_param)
    model.kv_bytes_per_element = kv_bytes_per_element(settings["kv_cache_dtype"], dtype)
    config = SimConfig.create(
        model,
        hardware,
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["max_num_batched_tokens"],
        kv_cache_memory=settings["kv_cache_memory"],
        max_model_len=settings["max_model_len"],
    )
    config = replace(config, front_latency_s=front)
    if settings.get("speculative_config"):
        spec = SpeculativeConfig.parse(settings["speculative_config"])
        config = replace(config, speculative=spec, spec_chances=chances or SpecChances())
    return config


def spec_chances(before: dict, after: dict) -> SpecChances:
    """The server's speculation over a run, from its counters before and after."""
    d = {k: after[k] - before[k] for k in before}
    return SpecChances.measured(d["spec_drafts"], d["spec_draft_tokens"],
                                d["spec_accepted_tokens"], d["spec_eligible"],
                                d["spec_proposed"])  # fmt: skip


def workload_of(settings: dict, rate: float, seed: int) -> list:
    prompt = LengthSpec.parse(settings["input_len"])
    output = LengthSpec.parse(settings["output_len"])
    return list(synthetic(settings["num_prompts"], rate, prompt, output, seed=seed,
                          prefix_tokens=settings["prefix_tokens"],
                          num_prefixes=settings["num_prefixes"]))  # fmt: skip


def held_out_steps(cost: CostModel, steps_file: Path, skip: int) -> dict:
    """The step model (no jitter, no gap) against the steps the server recorded past `skip`
    (a measured run's, held out from the fit): signed median and p90 |error|, and the ratio of
    predicted to measured busy time; the figures that tell a wrong step price from a wrong
    queue."""
    steps = recorded_steps(steps_file, skip)
    if not steps:
        return {"steps": 0, "median": 0.0, "p90_abs": 0.0, "busy_ratio": 0.0}
    predicted = [cost.price(BatchShape.from_seqs(s.seqs)).predicted_s for s in steps]
    errors = [p / s.duration - 1 for p, s in zip(predicted, steps)]
    by_kind = {}
    for kind in ("decode", "prefill", "mixed"):
        mine = [e for e, s in zip(errors, steps) if s.kind == kind]
        if mine:
            by_kind[kind] = {"steps": len(mine), "median": statistics.median(mine)}
    return {
        "steps": len(steps),
        "median": statistics.median(errors),
        "p90_abs": statistics.quantiles([abs(e) for e in errors], n=10)[-1]
        if len(errors) > 1
        else abs(errors[0]),
        "busy_ratio": sum(predicted) / sum(s.duration for s in steps),
        "by_kind": by_kind,
    }


def served_model(url: str) -> str:
    return httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]


COUNTERS = {
    "preemptions": "quill:num_preemptions_total",
    "prefix_cache_queries": "quill:prefix_cache_queries_total",
    "prefix_cache_hits": "quill:prefix_cache_hits_total",
    **{
        f"spec_{k}": f"quill:spec_decode_num_{k}_total"
        for k in ("drafts", "draft_tokens", "accepted_tokens", "eligible", "proposed")
    },
}


def counters(url: str) -> dict[str, float]:
    """The server's preemption and prefix-cache counters (Prometheus text, summed over labels)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = dict.fromkeys(COUNTERS, 0.0)
    for line in text.splitlines():
        for key, name in COUNTERS.items():
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[key] += float(line.rsplit(" ", 1)[1])
    return out


def measured_run(url: str, model_name: str, items, make_prompt) -> dict:
    """One real run of `items`: the client's summary, with the run's preemptions and prefix
    cache hit rate from the server's counters."""
    before = counters(url)
    summary = summarize(asyncio.run(run_workload(url, model_name, items, make_prompt)))
    after = counters(url)
    delta = {k: after[k] - before[k] for k in COUNTERS}
    summary["num_preemptions"] = delta["preemptions"]
    queries = delta["prefix_cache_queries"]
    summary["prefix_cache_hit_rate"] = delta["prefix_cache_hits"] / queries if queries else None
    drafted = delta["spec_draft_tokens"]
    summary["spec_acceptance_rate"] = delta["spec_accepted_tokens"] / drafted if drafted else None
    return summary


METRICS = [(m, q) for m in ("ttft_ms", "itl_ms", "e2e_ms") for q in ("p50", "p90", "p99")]


SIM_SEEDS = 32
AVERAGED = ("num_preemptions", "prefix_cache_hit_rate", "spec_acceptance_rate")


def simulate(config: SimConfig, items: list, seeds: int = SIM_SEEDS) -> dict:
    """The simulator's figures on `items`: each the mean over `seeds` runs, the seeds
    config.seed, +1, ...; the first run's report otherwise, and each scored figure's spread
    over the seeds (standard deviation / mean) under `seed_spread`."""
    runs = [run_colocated(replace(config, seed=config.seed + k), items)["results"]
            for k in range(seeds)]  # fmt: skip
    out = dict(runs[0], seeds=seeds, seed_spread={})
    for metric, q in [*METRICS, ("tok/s", None)]:
        values = [figure(r, metric, q) for r in runs]
        if any(v is None for v in values):
            continue
        mean = statistics.fmean(values)
        if q is None:
            out["output_throughput"] = mean
        else:
            out[metric] = {**out[metric], q: mean}
        key = metric if q is None else f"{metric[:-3]}_{q}"
        out["seed_spread"][key] = statistics.pstdev(values) / mean if mean else None
    for key in AVERAGED:
        values = [r.get(key) for r in runs]
        if values and all(isinstance(v, int | float) for v in values):
            out[key] = statistics.fmean(values)
    return out


def figure(summary: dict, metric: str, q: str | None) -> float | None:
    return summary["output_throughput"] if metric == "tok/s" else summary[metric][q]


def compare(reals: list[dict], sims: dict[str, dict]) -> dict:
    """Per figure: each real run's value, their spread (|a - b| / mean), and each simulation's
    error against the real runs' mean."""
    out = {}
    for metric, q in [*METRICS, ("tok/s", None)]:
        values = [figure(r, metric, q) for r in reals]
        if any(v is None for v in values):
            continue
        mean = sum(values) / len(values)
        row = {"server": values, "spread": (max(values) - min(values)) / mean if mean else None}
        for name, sim in sims.items():
            s = figure(sim, metric, q)
            row[name] = {
                "simulated": s,
                "error": None if not mean or s is None else (s - mean) / mean,
            }
        out[metric if q is None else f"{metric[:-3]}_{q}"] = row
    for key in ("num_preemptions", "prefix_cache_hit_rate", "spec_acceptance_rate"):  # reported
        out[key] = {"server": [r.get(key) for r in reals],
                    **{n: sim.get(key) for n, sim in sims.items()}}  # fmt: skip
    return out


def scored(row: dict) -> bool:
    return "spread" in row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hardware", help="calibrated spec (default: this machine's saved one)")
    p.add_argument("--model", help="model directory (default: the default model)")
    p.add_argument("--load-format", default="auto", help="dummy: random weights from the config")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default="none", help="the server's weights: none, int8, ...")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--prefix-tokens", type=int, default=0, help="tokens shared by prompts")
    p.add_argument("--num-prefixes", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="32")
    p.add_argument("--fractions", default="0.3,0.6,0.9", help="rates, as fractions of saturation")
    p.add_argument("--speculative-config", help="the server's (JSON); the simulator draws its "
                   "drafts with the chances measured during the serving refit")  # fmt: skip
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="real runs per rate (their spread)")
    p.add_argument(
        "--sim-seeds",
        type=int,
        default=SIM_SEEDS,
        help="simulated runs per rate, of other seeds: their mean is the figure",
    )
    p.add_argument(
        "--front-latency",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="add the measured time outside the engine before a first token (client TTFT - "
        "the server's, on the serving-calibration stream) to the simulated TTFT and E2E",
    )
    p.add_argument("--json", default=None, help="write every figure here")
    p.add_argument(
        "--serving-calibration",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="refit the step model on the server's own recorded steps first (default: on)",
    )
    args = p.parse_args(argv)

    if args.hardware:
        hardware = HardwareSpec.resolve(args.hardware)
        hardware_path = args.hardware
    else:
        found = find_calibration_file(args.dtype)
        if found is None:
            raise SystemExit("no calibration for this machine: run `quill cost calibrate` first")
        hardware, hardware_path = HardwareSpec.load(found), str(found)
    base_hardware = hardware
    settings = vars(args)
    config = sim_config(settings, hardware)
    model = config.cost.model
    model_dir = model_path(settings)

    def workload(rate: float, seed: int = args.seed):
        return workload_of(settings, rate, seed)

    def saturation(config: SimConfig) -> float:
        return run_colocated(config, workload(float("inf")))["results"]["request_throughput"]

    steps_file = Path(tempfile.mkdtemp()) / "steps.jsonl"
    flags = [
        model_dir,
        "--load-format", args.load_format,
        "--dtype", args.dtype,
        "--quantization", args.quantization,
        "--kv-cache-dtype", args.kv_cache_dtype,
        "--max-model-len", str(args.max_model_len),
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--hardware", hardware_path,
        "--record-steps", str(steps_file),
    ]  # fmt: skip
    if args.speculative_config:
        flags += ["--speculative-config", args.speculative_config]
    server = Server(flags)
    rng = random.Random(args.seed)
    vocab = range(100, 40000)

    prefixes: dict = {}

    def make_prompt(item) -> list[int]:
        """Random tokens; a prompt with a prefix_id starts with that prefix's own tokens."""
        shared = min(item.prefix_tokens, item.prompt_tokens) if item.prefix_id is not None else 0
        head = []
        if shared:
            if item.prefix_id not in prefixes:
                prefixes[item.prefix_id] = random_prompt(args.prefix_tokens, rng, vocab)
            head = prefixes[item.prefix_id][:shared]
        return head + random_prompt(item.prompt_tokens - shared, rng, vocab)

    runs = []
    fit_check = None  # the fitted steps against the model fitted on them (with the refit)
    chances = None  # speculation's, measured while refitting
    try:
        model_name = served_model(server.url)
        warm = workload_of(settings, math.inf, args.seed + 1)[:4]
        asyncio.run(run_workload(server.url, model_name, warm, lambda i: [7] * 8))
        num_warm = len(steps_file.read_text().splitlines())
        if args.serving_calibration:
            # The engine shares this machine with the HTTP side and the client: fit the step
            # model on steps the server recorded under load (another seed: held out).
            # Two loads, so the steps span small and full batches: a Poisson stream at 60% of
            # the calibration's saturation, and a burst of every request at once.
            fronts = []
            before = counters(server.url)
            for rate, seed in ((saturation(config) * 0.6, 100), (float("inf"), 101)):
                print(f"serving calibration: {args.num_prompts} requests at {rate:.3f} req/s")
                items = workload(rate, seed=args.seed + seed)
                records = asyncio.run(run_workload(server.url, model_name, items, make_prompt))
                if rate != float("inf"):  # a burst's requests queue in the API process too
                    fronts += [r.ttft - r.server_ttft for r in records
                               if r.ok and r.server_ttft is not None]  # fmt: skip
            if args.speculative_config:
                chances = spec_chances(before, counters(server.url))
                print(f"speculation while refitting: {chances}")
            lines = steps_file.read_text().splitlines()[num_warm:]
            recorded = steps_file.with_name("serving-steps.jsonl")
            recorded.write_text("\n".join(lines) + "\n")
            hardware = refit_spec(hardware, model, recorded_steps(recorded))
            fit_check = held_out_steps(CostModel(model, hardware), recorded, 0)
            gaps = step_gaps(read_steps(recorded))
            if gaps is not None:
                hardware.calibration["step_gap"] = gaps
            front = statistics.median(fronts) if fronts and args.front_latency else 0.0
            print(f"outside the engine before a first token (client TTFT - server's): median "
                  f"{front * 1e3:.1f} ms of {len(fronts)} requests")  # fmt: skip
            config = sim_config(settings, hardware, front, chances)
        top = saturation(config)
        rates = [top * float(f) for f in args.fractions.split(",")]
        print(f"simulated saturation {top:.3f} req/s; rates {', '.join(f'{r:.3f}' for r in rates)}")
        sims = variants(config, step_ratios_by_kind(hardware))
        for rate in rates:
            items = workload(rate)
            reals, checks = [], []
            for _ in range(args.repeats):
                # Each run's prompts share prefixes of their own: its prefix cache starts
                # cold, as the simulator's does (not warmed by the run before).
                prefixes.clear()
                seen = len(steps_file.read_text().splitlines())
                reals.append(measured_run(server.url, model_name, items, make_prompt))
                checks.append(held_out_steps(config.cost, steps_file, seen))
            speeds = run_speeds(checks, fit_check)
            simulated = {n: simulate(c, items, args.sim_seeds) for n, c in sims.items()}
            row = {"rate": rate, "server": reals, "simulated": simulated,
                   "compare": compare(reals, simulated), "steps": checks[-1],
                   "steps_by_run": checks, "run_speeds": speeds}  # fmt: skip
            runs.append(row)
            failed = sum(r["num_failed"] for r in reals)
            print(f"\nrate {rate:.3f} req/s ({failed} failed)")
            head = "".join(f"{n + ' err':>18}" for n in sims)
            print(f"{'':10}{'server (runs)':>22}{'spread':>8}{head}")
            steps = row["steps"]
            print(f"the last run's {steps['steps']} steps against the step model: median "
                  f"{steps['median']:+.1%}, p90 |error| {steps['p90_abs']:.1%}; predicted / "
                  f"measured busy time {steps['busy_ratio']:.3f}")  # fmt: skip
            if speeds:
                print("each run's steps took " + ", ".join(f"{x:.3f}x" for x in speeds)
                      + " the fitted steps' time, against the step model")  # fmt: skip
            for name, c in row["compare"].items():
                if not scored(c):
                    print(f"{name:22}{c}")
                    continue
                runs_text = "/".join(f"{v:.1f}" for v in c["server"])
                errs = "".join(f"{c[n]['error']:+18.1%}" if c[n]["error"] is not None
                               else f"{'-':>18}" for n in sims)  # fmt: skip
                spread = "-" if c["spread"] is None else f"{c['spread']:.1%}"
                print(f"{name:10}{runs_text:>22}{spread:>8}{errs}")
    finally:
        server.stop()
    summary = {}
    for n in dict.fromkeys(n for r in runs for n in r["simulated"]):
        rows = [c for r in runs for c in r["compare"].values() if scored(c)]
        mine = [c for c in rows if n in c and c[n]["error"] is not None]
        errors = [abs(c[n]["error"]) for c in mine]
        beyond = [abs(c[n]["error"]) - c["spread"] for c in mine]
        summary[n] = {
            "median_abs_error": statistics.median(errors) if errors else None,
            "max_abs_error": max(errors) if errors else None,
            "max_error_beyond_spread": max(beyond) if beyond else None,
        }
        print(f"{n}: |error| median {summary[n]['median_abs_error']:.1%}, max "
              f"{summary[n]['max_abs_error']:.1%}; worst beyond the real runs' spread "
              f"{summary[n]['max_error_beyond_spread']:+.1%}")  # fmt: skip
    verdict = summary["sim"]["max_abs_error"]
    if args.json:
        result = {
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv),
            "machine": cpu_info(),
            "hardware": base_hardware.to_dict(),
            "settings": vars(args),
            "saturation_request_rate": top,
            "simulated_with": hardware.to_dict(),
            "front_latency_s": config.front_latency_s,
            "fitted_steps": fit_check,
            "spec_chances": None if chances is None else asdict(chances),
            "runs": runs,
            "worst_error": verdict,
            "summary": summary,
        }
        # Every step the server recorded (warm-up, the refit's from `num_warm` on, then the
        # runs'), kept so that a later model of the steps can be fitted on the same ones.
        record = Path(f"{args.json}.steps.jsonl.gz")
        record.write_bytes(gzip.compress(steps_file.read_bytes(), mtime=0))
        result["steps_record"] = {"file": record.name, "refit_from_line": num_warm}
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
