"""Engine benchmark: quill against Hugging Face transformers, same weights, same dtype, one run.

Measures the wait (prefill of a 512- and a 2000-token prompt) and the pace (decode step time
and output tokens/s at 1, 4, 16 and 64 concurrent sequences of 128 new tokens), and prints
quill/transformers ratios. Usage:

    .venv/bin/python benchmarks/bench_engine.py [--dtype float32] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from datetime import UTC, datetime

import torch

from quill import LLM, SamplingParams
from quill.model.default_model import default_model_dir


def prompt_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def quill_prefill(llm: LLM, n: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        out = llm.generate([prompt_ids(n, r)], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        times.append(out.metrics.time_to_first_token)
    return min(times)


def quill_decode(llm: LLM, batch: int, new_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(prompt_ids(32, 1000 + i), params)
    step_times = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        if engine.last_step and engine.last_step.num_prefill_tokens == 0:
            step_times.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    return {
        "step_ms": 1000 * statistics.median(step_times),
        "tokens_per_s": batch * new_tokens / total,
    }


def hf_prefill(model, n: int, repeats: int) -> float:
    times = []
    for r in range(repeats):
        ids = torch.tensor([prompt_ids(n, r)])
        with torch.inference_mode():
            t = time.perf_counter()
            model(ids, logits_to_keep=1)
            times.append(time.perf_counter() - t)
    return min(times)


def hf_decode(model, batch: int, new_tokens: int) -> dict:
    ids = torch.tensor([prompt_ids(32, 1000 + i) for i in range(batch)])
    with torch.inference_mode():
        t = time.perf_counter()
        model(ids, logits_to_keep=1)
        prefill = time.perf_counter() - t
        t = time.perf_counter()
        model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        total = time.perf_counter() - t
    return {
        "step_ms": 1000 * max(total - prefill, 0) / (new_tokens - 1),
        "tokens_per_s": batch * new_tokens / total,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prompts", default="512,2000")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; best kept")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(p) for p in args.prompts.split(",")]

    llm = LLM(dtype=args.dtype, kv_cache_memory=1 << 30, compile=args.compile)
    dtype = llm.engine.dtype
    model = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(default_model_dir()), dtype=dtype).eval()
    results: dict = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()} {platform.processor() or ''} "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}",
        "dtype": str(dtype),
        "token_budget": llm.engine.scheduler.token_budget,
        "quill": {"prefill_s": {}, "decode": {}},
        "transformers": {"prefill_s": {}, "decode": {}},
    }
    # Warm-up: first calls allocate and pick kernels.
    llm.generate([prompt_ids(64, 99)], SamplingParams(max_tokens=4), use_tqdm=False)
    if model is not None:
        hf_prefill(model, 64, 1)
    q, h = results["quill"], results["transformers"]
    # The machine is shared and its speed drifts: each measurement alternates quill and
    # transformers, round after round, and keeps each side's best.
    for n in prompts:
        for _ in range(args.rounds):
            q["prefill_s"][n] = min(q["prefill_s"].get(n, 1e9), quill_prefill(llm, n, 1))
            if model is not None:
                h["prefill_s"][n] = min(h["prefill_s"].get(n, 1e9), hf_prefill(model, n, 1))
        print(
            f"prefill {n}: quill {q['prefill_s'][n]:.3f} s, hf {h['prefill_s'].get(n)}", flush=True
        )
    for b in batches:
        for _ in range(args.rounds):
            q["decode"][b] = _best(q["decode"].get(b), quill_decode(llm, b, args.new_tokens))
            if model is not None:
                h["decode"][b] = _best(h["decode"].get(b), hf_decode(model, b, args.new_tokens))
        print(f"decode x{b}: quill {q['decode'][b]}, hf {h['decode'].get(b)}", flush=True)

    print_table(results, prompts, batches)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def _best(old: dict | None, new: dict) -> dict:
    if old is None:
        return new
    return {
        "step_ms": min(old["step_ms"], new["step_ms"]),
        "tokens_per_s": max(old["tokens_per_s"], new["tokens_per_s"]),
    }


def print_table(results: dict, prompts: list[int], batches: list[int]) -> None:
    q, h = results["quill"], results["transformers"]
    print(f"\n{results['machine']}, {results['dtype']}, {results['date']}")
    print("| measure | quill | transformers | quill / transformers |")
    print("|---|---|---|---|")
    for n in prompts:
        qs, hs = q["prefill_s"][n], h["prefill_s"].get(n)
        ratio = f"{hs / qs:.2f}x faster" if hs else "-"
        print(f"| prefill {n} tokens | {qs:.2f} s | {hs or 0:.2f} s | {ratio} |")
    for b in batches:
        qd, hd = q["decode"][b], h["decode"].get(b)
        if hd:
            step_ratio = f"{hd['step_ms'] / qd['step_ms']:.2f}x faster"
            tps_ratio = f"{qd['tokens_per_s'] / hd['tokens_per_s']:.2f}x"
        else:
            step_ratio = tps_ratio = "-"
        hd = hd or {"step_ms": 0, "tokens_per_s": 0}
        print(
            f"| decode step, {b} seqs | {qd['step_ms']:.1f} ms | {hd['step_ms']:.1f} ms "
            f"| {step_ratio} |"
        )
        print(
            f"| output tok/s, {b} seqs | {qd['tokens_per_s']:.0f} | {hd['tokens_per_s']:.0f} "
            f"| {tps_ratio} |"
        )


if __name__ == "__main__":
    main()
