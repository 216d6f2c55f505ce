"""How steady is this machine's speed? A control for every timed comparison made on it.

A fixed piece of work shaped like a small model's decode step (a pass over a 256 MB array, as
a step streams its weights, and a 1 x 2048 x 2048 matrix product) runs back to back for
`--seconds`, with nothing else of quill running. The median time of each `--window`-second
window is printed, and then the machine's speed states: the windows grouped where they sit
more than `--gap` apart, each state's median and share of the windows, and the ratio of the
slowest state to the fastest.

A shared virtual machine can switch between speed states for tens of seconds at a time: a
simulator fitted in one state and compared with a run made in the other misses by their
ratio, which no step model can foresee. Run this beside (never during) a validation to know
what the machine alone contributes.

    .venv/bin/python benchmarks/probe_machine_speed.py --seconds 300 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from datetime import UTC, datetime


def windows(seconds: float, window: float, threads: int) -> list[dict]:
    import torch

    torch.set_num_threads(threads)
    weights = torch.randn(64 * 2**20)  # 256 MB of float32
    matrix, vector = torch.randn(2048, 2048), torch.randn(1, 2048)
    out, times = [], []
    start = begin = time.monotonic()
    while time.monotonic() - begin < seconds:
        t = time.perf_counter()
        weights.sum()
        vector @ matrix
        times.append(time.perf_counter() - t)
        now = time.monotonic()
        if now - start >= window:
            row = {"t": round(start - begin, 1), "median_ms": statistics.median(times) * 1e3,
                   "n": len(times)}  # fmt: skip
            print(f"t={row['t']:7.1f} s  median {row['median_ms']:6.2f} ms  ({row['n']} passes)",
                  flush=True)  # fmt: skip
            out.append(row)
            times, start = [], now
    return out


def states(rows: list[dict], gap: float) -> list[dict]:
    """Windows grouped into speed states: sorted by time per pass, a new state wherever the
    next window is more than `gap` (a fraction) slower than the one before."""
    ordered = sorted(r["median_ms"] for r in rows)
    groups: list[list[float]] = [[ordered[0]]] if ordered else []
    for value in ordered[1:]:
        if value > groups[-1][-1] * (1 + gap):
            groups.append([])
        groups[-1].append(value)
    return [{"median_ms": statistics.median(g), "share": len(g) / len(ordered)} for g in groups]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--window", type=float, default=3.0)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: every core)")
    p.add_argument("--gap", type=float, default=0.1, help="between states: this much slower")
    p.add_argument("--json", help="write the windows and states here")
    argv = sys.argv[1:] if argv is None else argv
    args = p.parse_args(argv)

    threads = args.threads or len(os.sched_getaffinity(0))
    rows = windows(args.seconds, args.window, threads)
    found = states(rows, args.gap)
    print("\nspeed states (ms per pass, share of the windows):")
    for s in found:
        print(f"  {s['median_ms']:6.2f} ms  {s['share']:5.0%}")
    ratio = found[-1]["median_ms"] / found[0]["median_ms"] if found else 1.0
    pairs = [sorted((a["median_ms"], b["median_ms"])) for a, b in zip(rows, rows[1:])]
    switches = sum(1 for low, high in pairs if high > low * (1 + args.gap))
    print(f"slowest / fastest state: {ratio:.2f}; {switches} switches in {len(rows)} windows")
    if args.json:
        from quill.cost.calibrate import cpu_info

        with open(args.json, "w") as f:
            json.dump({"date": datetime.now(UTC).isoformat(timespec="seconds"),
                       "command": "benchmarks/probe_machine_speed.py " + " ".join(argv),
                       "machine": cpu_info(), "threads": threads, "windows": rows,
                       "states": found, "slowest_over_fastest": ratio,
                       "switches": switches}, f, indent=1)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
