"""The simulator against the real server: the same Poisson workload, three rates up to saturation.

The simulator is only worth planning with if, for the machine it was calibrated on, it predicts
what a client of the real server sees. This starts `quill serve` (same scheduler settings, the
calibrated hardware spec), sends the same workload to it (streaming, one chunk per token,
timestamped on arrival) and to `quill simulate`'s engine loop in virtual time, and compares
TTFT and inter-token latency at p50 and p99. Target: within 20%.

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


def compare(real: dict, sim: dict) -> dict:
    out = {}
    for metric in ("ttft_ms", "itl_ms"):
        for q in ("p50", "p99"):
            r, s = real[metric][q], sim[metric][q]
            out[f"{metric[:-3]}_{q}"] = {
                "server_ms": r,
                "simulated_ms": s,
                "error": None if not r or s is None else (s - r) / r,
            }
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
            for rate, seed in ((saturation(config) * 0.6, 100), (float("inf"), 101)):
                print(f"serving calibration: {args.num_prompts} requests at {rate:.3f} req/s")
                items = workload(rate, seed=args.seed + seed)
                asyncio.run(run_workload(server.url, model_name, items, make_prompt))
            lines = steps_file.read_text().splitlines()[num_warm:]
            recorded = steps_file.with_name("serving-steps.jsonl")
            recorded.write_text("\n".join(lines) + "\n")
            fitted = steps_file.with_name("serving.json")
            calibrate_main(
                ["--from-steps", str(recorded), "--base", hardware_path, "--out", str(fitted)]
            )
            hardware = HardwareSpec.load(fitted)
            config = replace(config, cost=CostModel(model, hardware))
        top = saturation(config)
        rates = [top * float(f) for f in args.fractions.split(",")]
        print(f"simulated saturation {top:.3f} req/s; rates {', '.join(f'{r:.3f}' for r in rates)}")
        for rate in rates:
            items = workload(rate)
            records = asyncio.run(run_workload(server.url, model_name, items, make_prompt))
            real = summarize(records)
            sim = run_colocated(config, items)["results"]
            row = {"rate": rate, "server": real, "simulated": sim, "compare": compare(real, sim)}
            runs.append(row)
            print(f"\nrate {rate:.3f} req/s ({real['num_failed']} failed)")
            print(f"{'':10}{'server ms':>12}{'simulated ms':>14}{'error':>9}")
            for name, c in row["compare"].items():
                err = "-" if c["error"] is None else f"{c['error']:+.1%}"
                print(f"{name:10}{c['server_ms']:12.1f}{c['simulated_ms']:14.1f}{err:>9}")
    finally:
        server.stop()
    errors = [
        abs(c["error"]) for r in runs for c in r["compare"].values() if c["error"] is not None
    ]
    verdict = max(errors) if errors else None
    print(f"\nworst |error| over TTFT/ITL p50/p99 at {len(runs)} rates: {verdict:.1%} (target 20%)")
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
        }
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
