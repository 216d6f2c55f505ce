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

Rates: the simulator's saturated throughput (every request at once) sets the top one; the other
two are fractions of it (`--fractions`, default 0.3, 0.6, 0.9: exactly at saturation a queue
grows without bound in both, and any error in the service rate is multiplied many times).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

from quill.bench.client import random_prompt, run_workload, summarize
from quill.cost.calibrate import cpu_info
from quill.cost.calibrate import main as calibrate_main
from quill.cost.hardware import HardwareSpec
from quill.cost.live import find_calibration_file
from quill.cost.model import ModelSpec, bytes_per_element
from quill.cost.step import CostModel
from quill.sim.cluster import run_colocated
from quill.sim.config import SimConfig
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


METRICS = [(m, q) for m in ("ttft_ms", "itl_ms", "e2e_ms") for q in ("p50", "p90", "p99")]


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
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--hardware", help="calibrated spec (default: this machine's saved one)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", default="128")
    p.add_argument("--output-len", default="32")
    p.add_argument("--fractions", default="0.3,0.6,0.9", help="rates, as fractions of saturation")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--kv-cache-memory", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=2, help="real runs per rate (their spread)")
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
    from quill.model.default_model import default_model_dir

    model_dir = default_model_dir()
    model = ModelSpec.from_path(model_dir, bytes_per_param=bytes_per_element(args.dtype))
    config = SimConfig.create(
        model,
        hardware,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory=args.kv_cache_memory,
        context_len=8192,
    )
    prompt, output = LengthSpec.parse(args.input_len), LengthSpec.parse(args.output_len)

    def workload(rate: float, seed: int = args.seed):
        return list(synthetic(args.num_prompts, rate, prompt, output, seed=seed))

    def saturation(config: SimConfig) -> float:
        return run_colocated(config, workload(float("inf")))["results"]["request_throughput"]

    steps_file = Path(tempfile.mkdtemp()) / "steps.jsonl"
    flags = [
        "--dtype", args.dtype,
        "--max-num-seqs", str(args.max_num_seqs),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
        "--kv-cache-memory", str(args.kv_cache_memory),
        "--hardware", hardware_path,
        "--record-steps", str(steps_file),
    ]  # fmt: skip
    server = Server(flags)
    rng = random.Random(args.seed)
    vocab = range(100, 40000)

    def make_prompt(item) -> list[int]:
        return random_prompt(item.prompt_tokens, rng, vocab)

    runs = []
    try:
        model_name = "SmolLM2-135M-Instruct"
        warm = synthetic(4, float("inf"), prompt, output, seed=args.seed + 1)
        asyncio.run(run_workload(server.url, model_name, list(warm), lambda i: [7] * 8))
        num_warm = len(steps_file.read_text().splitlines())
        if args.serving_calibration:
            # The engine shares this machine with the HTTP side and the client: fit the step
            # model on steps the server recorded under load (another seed: held out).
            # Two loads, so the steps span small and full batches: a Poisson stream at 60% of
            # the calibration's saturation, and a burst of every request at once.
            fronts = []
            for rate, seed in ((saturation(config) * 0.6, 100), (float("inf"), 101)):
                print(f"serving calibration: {args.num_prompts} requests at {rate:.3f} req/s")
                items = workload(rate, seed=args.seed + seed)
                records = asyncio.run(run_workload(server.url, model_name, items, make_prompt))
                if rate != float("inf"):  # a burst's requests queue in the API process too
                    fronts += [r.ttft - r.server_ttft for r in records
                               if r.ok and r.server_ttft is not None]  # fmt: skip
            lines = steps_file.read_text().splitlines()[num_warm:]
            recorded = steps_file.with_name("serving-steps.jsonl")
            recorded.write_text("\n".join(lines) + "\n")
            fitted = steps_file.with_name("serving.json")
            calibrate_main(
                ["--from-steps", str(recorded), "--base", hardware_path, "--out", str(fitted)]
            )
            hardware = HardwareSpec.load(fitted)
            front = statistics.median(fronts) if fronts and args.front_latency else 0.0
            print(f"outside the engine before a first token (client TTFT - server's): median "
                  f"{front * 1e3:.1f} ms of {len(fronts)} requests")  # fmt: skip
            config = replace(config, cost=CostModel(model, hardware), front_latency_s=front)
        top = saturation(config)
        rates = [top * float(f) for f in args.fractions.split(",")]
        print(f"simulated saturation {top:.3f} req/s; rates {', '.join(f'{r:.3f}' for r in rates)}")
        sims = {"sim": config, "sim-jitter-off": replace(config, step_jitter=None)}
        if config.step_jitter is None:
            del sims["sim-jitter-off"]
        for rate in rates:
            items = workload(rate)
            reals = [summarize(asyncio.run(run_workload(server.url, model_name, items,
                                                        make_prompt)))
                     for _ in range(args.repeats)]  # fmt: skip
            simulated = {n: run_colocated(c, items)["results"] for n, c in sims.items()}
            row = {"rate": rate, "server": reals, "simulated": simulated,
                   "compare": compare(reals, simulated)}  # fmt: skip
            runs.append(row)
            failed = sum(r["num_failed"] for r in reals)
            print(f"\nrate {rate:.3f} req/s ({failed} failed)")
            head = "".join(f"{n + ' err':>18}" for n in sims)
            print(f"{'':10}{'server (runs)':>22}{'spread':>8}{head}")
            for name, c in row["compare"].items():
                runs_text = "/".join(f"{v:.1f}" for v in c["server"])
                errs = "".join(f"{c[n]['error']:+18.1%}" for n in sims)
                print(f"{name:10}{runs_text:>22}{c['spread']:8.1%}{errs}")
    finally:
        server.stop()
    summary = {}
    for n in sims:
        errors = [abs(c[n]["error"]) for r in runs for c in r["compare"].values()
                  if c[n]["error"] is not None]  # fmt: skip
        beyond = [abs(c[n]["error"]) - c["spread"] for r in runs for c in r["compare"].values()
                  if c[n]["error"] is not None]  # fmt: skip
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
            "runs": runs,
            "worst_error": verdict,
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
