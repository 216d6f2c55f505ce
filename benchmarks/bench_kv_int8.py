"""Decode over long contexts with an int8 KV cache (issue 44): quill's int8 cache against its
16-bit one and against llama.cpp's q8_0 cache (`-ctk q8_0 -ctv q8_0 -fa on`), one GGUF file.

For each case `SxC` (S sequences of C random prompt tokens each, then N new tokens each), in
rounds that alternate the order of the sides, each side in a fresh process:

- quill, `--kv-cache-dtype bfloat16` and `int8`: the mean time of the steps in which every
  sequence decodes (no prompt token in the step), and the pool's tokens for the same
  `kv_cache_memory` (the 16-bit side's need: S x (C + N) tokens);
- llama.cpp: llama-batched-bench `-npp C -ntg N -npl S` with q8_0 K and V: its decode time per
  step (t_tg / N).

Best of the rounds per side; ratios: quill int8's step time over its 16-bit one's (the target:
at most 0.65), and quill int8's tokens/s over llama.cpp q8_0's (at least 1.5). Usage:

    .venv/bin/python benchmarks/bench_kv_int8.py default llama-3.2-1b:Q4_K_M \\
        [--cases 16x1500,64x1500,16x8000] [--new-tokens 32] [--rounds 1] [--json out.json]

`default` is the default model's GGUF (Q8_0; benchmarks/peers/build_llama_cpp.sh makes it);
`shape:TYPE` a file of benchmarks/real_shapes.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import llama_cpp  # noqa: E402


def resolve(spec: str) -> Path:
    if spec == "default":
        return llama_cpp.model_path("q8_0")
    if ":" in spec and not Path(spec).exists():
        from benchmarks.real_shapes import gguf_files

        shape, kind = spec.split(":")
        return gguf_files(shape, [kind])[kind]
    return Path(spec)


# --- quill's side: run in its own process (`--quill-side`) ---------------------------------------


def quill_side(path: str, kv: str, streams: int, context: int, new_tokens: int, threads: int):
    import torch

    from quill import LLM, SamplingParams
    from quill.model.loader import read_model_config

    torch.set_num_threads(threads)
    config = read_model_config(path, "auto")
    # Prompts are taken in chunks beside the decodes of those already in: the first ones keep
    # decoding until the last prompt is in, so that `new_tokens` steps decode every sequence;
    # prompts short of `context` by half the prompt steps put the sequences' mean context at
    # `context` then (the first ones above it, the last below).
    budget = 512
    prefill_steps = -(-streams * context // budget)
    max_tokens = new_tokens + prefill_steps + 2
    prompt_len = context - prefill_steps // 2
    max_len = prompt_len + max_tokens + 16
    kv_bytes = streams * max_len * config.kv_bytes_per_token * 2  # what the 16-bit cache needs
    llm = LLM(
        path,
        kv_cache_dtype=kv,
        kv_cache_memory=kv_bytes,
        enable_prefix_caching=False,
        max_num_seqs=streams,
        max_model_len=max_len,
        max_num_batched_tokens=budget,
    )
    engine = llm.engine
    gen = torch.Generator().manual_seed(streams * 7919 + context)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for _ in range(streams):
        ids = torch.randint(10, config.vocab_size - 10, (prompt_len,), generator=gen).tolist()
        engine.add_request(ids, params)
    steps = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        _, stats = engine.step_with_stats()
        if stats is None or stats.num_prefill_tokens:
            continue
        if stats.num_decode_tokens == streams:  # every sequence decoding
            steps.append(stats.duration)
            if len(steps) == new_tokens:
                break
    total = time.perf_counter() - start
    steps.sort()
    step = sum(steps[1:-1]) / max(1, len(steps) - 2)  # the extremes out
    return {
        "step_ms": 1e3 * step,
        "decode_tok_s": streams / step,
        "decode_steps": len(steps),
        # What the same bytes hold (the pool itself stops at max_num_seqs full contexts).
        "pool_tokens": kv_bytes // engine.runner.kv_bytes_per_block() * engine.runner.block_size,
        "kv_format": engine.kv_format.name,
        "wall_s": total,
    }


def run_quill(path: Path, kv: str, streams: int, context: int, args) -> dict:
    cmd = [sys.executable, __file__, "--quill-side", str(path), kv, str(streams), str(context),
           str(args.new_tokens), str(args.threads)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=7200)
    if out.returncode != 0:
        raise RuntimeError(f"quill side failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_llama(path: Path, streams: int, context: int, args) -> dict:
    res = llama_cpp.batched_bench(
        path,
        npp=context,
        ntg=args.new_tokens,
        npl=(streams,),
        threads=args.threads,
        extra=("-ctk", "q8_0", "-ctv", "q8_0"),
        timeout=7200,
    )[streams]
    return {"step_ms": res["step_ms"], "decode_tok_s": res["decode_tokens_per_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="*", default=["default"])
    parser.add_argument("--cases", default="16x1500,64x1500,16x8000")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--sides", default="bfloat16,int8,llama.cpp")
    parser.add_argument("--json", default=None)
    parser.add_argument("--quill-side", nargs=6, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quill_side:
        path, kv, s, c, n, t = args.quill_side
        print(json.dumps(quill_side(path, kv, int(s), int(c), int(n), int(t))))
        return
    from benchmarks.engine.machine import machine_info

    info = machine_info(args.threads)
    sides = args.sides.split(",")
    results = []
    for spec in args.models:
        path = resolve(spec)
        for case in args.cases.split(","):
            streams, context = (int(x) for x in case.split("x"))
            best: dict[str, dict] = {}
            for r in range(args.rounds):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    if side == "llama.cpp":
                        res = run_llama(path, streams, context, args)
                    else:
                        res = run_quill(path, side, streams, context, args)
                    print(f"{spec} {case} {side}: {res}", flush=True)
                    if side not in best or res["step_ms"] < best[side]["step_ms"]:
                        best[side] = res
            results.append({"model": spec, "file": path.name, "case": case, "sides": best})
    print(f"\n{info['cpu']} ({' '.join(info['cpu_flags'])}), {args.threads} threads")
    print(f"{args.new_tokens} new tokens a sequence; best of {args.rounds} round(s)\n")
    print(
        "| model | case | quill 16-bit step ms | quill int8 step ms | int8 / 16-bit | "
        "llama.cpp q8_0 step ms | quill int8 / llama.cpp tok/s | pool tokens int8 / 16-bit |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in results:
        s = row["sides"]
        b, i, ll = s.get("bfloat16"), s.get("int8"), s.get("llama.cpp")

        def ms(x):
            return f"{x['step_ms']:.1f}" if x else ""

        ratio = f"{i['step_ms'] / b['step_ms']:.2f}x" if i and b else ""
        vs = f"{i['decode_tok_s'] / ll['decode_tok_s']:.2f}x" if i and ll else ""
        pool = f"{i['pool_tokens'] / b['pool_tokens']:.2f}x" if i and b else ""
        cells = [row["model"], row["case"], ms(b), ms(i), ratio, ms(ll), vs, pool]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        out = {"machine": info, "new_tokens": args.new_tokens, "rounds": args.rounds,
               "llama_cpp": llama_cpp.build_info(), "date": time.strftime("%Y-%m-%d"),
               "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
