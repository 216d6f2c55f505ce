"""A long prompt in chunks: time to first token, native attention against the PyTorch path.

Why: after its first chunk a prompt attends over its own cached context, which the PyTorch path
gathers into a workspace and masks densely; the native kernel reads the blocks in place and is
causal inside the chunk. This times a fresh 2,000-token prompt (random ids, so no prefix cache
can serve it) taken in chunks of the engine's 512-token budget, and in one 2,048-token chunk,
with each attention path in the same process, alternating round by round. Usage:

    .venv/bin/python benchmarks/bench_chunked_prefill.py [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.machine import machine_info  # noqa: E402
from benchmarks.engine.variants import prompt_ids  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.ops import library  # noqa: E402


def ttft(llm: LLM, tokens: int, seed: int) -> float:
    out = llm.generate([prompt_ids(tokens, seed)], SamplingParams(max_tokens=1), use_tqdm=False)
    return out[0].metrics.time_to_first_token


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if library.load() is None:
        raise SystemExit("no native library for this CPU: run `make setup`")
    budgets = {"512-token chunks": 512, "one chunk": 2048}
    llms = {name: LLM(max_num_batched_tokens=b) for name, b in budgets.items()}
    best: dict[tuple[str, str], float] = {}
    seed = 0
    for r in range(args.rounds):
        for name, llm in llms.items():
            paths = ("native", "reference") if r % 2 == 0 else ("reference", "native")
            for path in paths:
                for layout in llm.engine.runner.layouts:
                    layout.native = path == "native"
                seed += 1
                t = ttft(llm, args.tokens, 1000 + seed)
                best[name, path] = min(best.get((name, path), float("inf")), t)
                print(f"round {r + 1} {name} {path}: {t:.3f} s", flush=True)
    engine = next(iter(llms.values())).engine
    info = machine_info(torch.get_num_threads())
    flags = " ".join(info["cpu_flags"])
    print(f"\n{info['cpu']} ({flags}), {engine.dtype}, KV {engine.kv_format}")
    print(f"\n| {args.tokens}-token prompt | native s | PyTorch path s | native / PyTorch |")
    print("|---|---|---|---|")
    for name in llms:
        native, ref = best[name, "native"], best[name, "reference"]
        print(f"| {name} | {native:.3f} | {ref:.3f} | {native / ref:.2f} |")
    if args.json:
        rows = {f"{name} {path}": t for (name, path), t in best.items()}
        doc = {"machine": info, "settings": vars(args), "best_ttft_s": rows}
        Path(args.json).write_text(json.dumps(doc, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
