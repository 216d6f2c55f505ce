"""A long newcomer among short decodes: does it cost the short ones more than its own KV bytes?

Why: attention that pads every sequence to the batch's longest context makes one long request
slow down every short one it joins (issue 7 measured a 2,000-token newcomer tripling the step of
16 short streams). quill's native kernel reads each sequence's own blocks, so the step with the
newcomer should cost what the cost model prices for it: its weights, its FLOPs, and the KV bytes
each sequence really has. This runs 16 short requests (32-token prompts) decoding, times their
steps, adds one 2,000-token request, and once it decodes beside them times those steps too,
each beside the engine's own calibrated price for it (`quill cost calibrate` first: the price
needs this machine's coefficients). Both attention paths run in the same process, alternating
round by round: the native kernel and the PyTorch reference (gather + SDPA, padded). Usage:

    .venv/bin/python benchmarks/bench_newcomer.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.machine import machine_info  # noqa: E402
from benchmarks.engine.variants import prompt_ids  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.ops import library, probe  # noqa: E402


def decode_steps(engine, steps: int, expect: int) -> list[tuple[float, float]]:
    """(measured, predicted) seconds of the next `steps` steps decoding `expect` sequences."""
    out = []
    while len(out) < steps:
        start = time.perf_counter()
        engine.step()
        measured = time.perf_counter() - start
        s = engine.last_step
        if s and s.num_prefill_tokens == 0 and s.num_decode_tokens == expect:
            out.append((measured, engine.accountant.last.cost.predicted_s))
    return out


def one_round(llm: LLM, short: int, long_len: int, steps: int, seed: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=4000, temperature=0, ignore_eos=True)
    ids = [engine.add_request(prompt_ids(32, seed + i), params) for i in range(short)]
    try:
        alone = decode_steps(engine, steps, short)
        ids.append(engine.add_request(prompt_ids(long_len, seed + 999), params))
        joined = decode_steps(engine, steps, short + 1)
    finally:
        for rid in ids:
            engine.abort_request(rid)
        while engine.has_unfinished_requests():
            engine.step()
    return {
        "alone_s": statistics.median(m for m, _ in alone),
        "alone_predicted_s": statistics.median(p for _, p in alone),
        "joined_s": statistics.median(m for m, _ in joined),
        "joined_predicted_s": statistics.median(p for _, p in joined),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--short", type=int, default=16, help="short requests decoding")
    parser.add_argument("--long", type=int, default=2000, help="the newcomer's prompt tokens")
    parser.add_argument("--steps", type=int, default=12, help="timed steps before and after")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if library.load() is None:
        raise SystemExit("no native library for this CPU: run `make setup`")
    # quantization none: the calibration sweep prices the float weights.
    llm = LLM(quantization="none", enable_prefix_caching=False)
    engine = llm.engine
    if engine.accountant.cost_model is None:
        raise SystemExit("no calibration for this machine: run `quill cost calibrate` first")
    layouts = engine.runner.layouts
    results = {"native": [], "reference": []}
    bandwidth = []
    for r in range(args.rounds):
        bandwidth.append(probe.read_bandwidth())
        for path in ("native", "reference") if r % 2 == 0 else ("reference", "native"):
            for layout in layouts:
                layout.native = path == "native"
            results[path].append(one_round(llm, args.short, args.long, args.steps, 100 * r))
            print(f"round {r + 1} {path}: {results[path][-1]}", flush=True)
    for layout in layouts:
        layout.native = True
    kv_per_token = engine.model_config.kv_bytes_per_token * engine.kv_format.bytes_per_element
    newcomer_bytes = args.long * kv_per_token
    bw = max(bandwidth)
    info = machine_info(torch.get_num_threads())
    flags = " ".join(info["cpu_flags"])
    print(f"\n{info['cpu']} ({flags}), {engine.dtype}, KV {engine.kv_format}")
    print(
        f"newcomer's KV: {newcomer_bytes / 1e6:.1f} MB per step = "
        f"{1e3 * newcomer_bytes / bw:.2f} ms at the probe's {bw / 1e9:.1f} GB/s\n"
    )
    print("| path | alone ms | with the newcomer ms | added ms | its price ms | measured / price |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for path, rounds in results.items():
        alone = min(x["alone_s"] for x in rounds)
        joined = min(x["joined_s"] for x in rounds)
        price = statistics.median(x["joined_predicted_s"] for x in rounds)
        summary[path] = {"alone_s": alone, "joined_s": joined, "joined_predicted_s": price}
        print(
            f"| {path} | {alone * 1e3:.1f} | {joined * 1e3:.1f} | {(joined - alone) * 1e3:.1f} | "
            f"{price * 1e3:.1f} | {joined / price:.2f} |"
        )
    if args.json:
        doc = {
            "machine": info,
            "settings": vars(args),
            "newcomer_kv_bytes": newcomer_bytes,
            "probe_Bps": bandwidth,
            "rounds": results,
            "summary": summary,
        }
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
