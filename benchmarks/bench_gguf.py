"""GGUF files as their users run them: quill against llama.cpp on the same file (issue 42).

For each file (a path, or `shape:TYPE` made by benchmarks/real_shapes.py, e.g.
`llama-3.1-8b:Q4_K_M`), in rounds that alternate the two sides, each side in a fresh process:

- load: seconds until ready (quill: `LLM(path)` returns; llama.cpp: llama-server answers
  /health, polled);
- batch 1: decode tokens/s of one sequence (llama-bench `-p 0 -n N`; quill: decode steps only);
- streams: decode tokens/s of 16 sequences with 32-token prompts (llama-batched-bench's S_TG;
  quill: the decode steps' tokens over their time);
- prompt: seconds for a 512-token prompt (llama-bench `-p 512`; quill: time to first token);
- peak RSS of the process that served the streams, both sides with the same KV tokens
  (streams x (prompt + new tokens)): llama.cpp's context and quill's kv_cache_memory.

Best of the rounds for each figure; ratios quill / llama.cpp (for the prompt, llama.cpp's time
over quill's, so above 1 is quill faster everywhere). Usage:

    .venv/bin/python benchmarks/bench_gguf.py llama-3.2-1b:Q4_K_M llama-3.1-8b:Q4_K_M
        [--rounds 2] [--new-tokens 128] [--streams 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.peers import llama_cpp  # noqa: E402

PROMPT = 32


def resolve(spec: str) -> Path:
    if ":" in spec and not Path(spec).exists():
        from benchmarks.real_shapes import gguf_files

        shape, kind = spec.split(":")
        return gguf_files(shape, [kind])[kind]
    return Path(spec)


def kv_tokens(streams: int, new_tokens: int) -> int:
    return streams * (PROMPT + new_tokens)


# --- quill's side: run in its own process (`--quill-side`) ---------------------------------------


def quill_side(path: str, streams: int, new_tokens: int, prompt_len: int, threads: int) -> dict:
    import statistics

    import torch

    from quill import LLM, SamplingParams
    from quill.model.loader import read_model_config

    torch.set_num_threads(threads)
    config = read_model_config(path, "auto")
    kv_bytes = kv_tokens(streams, new_tokens) * config.kv_bytes_per_token * 2  # bf16
    t = time.perf_counter()
    llm = LLM(path, kv_cache_memory=kv_bytes, enable_prefix_caching=False, max_num_seqs=streams)
    load_s = time.perf_counter() - t
    engine = llm.engine
    vocab = config.vocab_size

    def decode(batch: int, seed: int) -> float:
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        gen = torch.Generator().manual_seed(seed)
        for _ in range(batch):
            ids = torch.randint(10, vocab - 10, (PROMPT,), generator=gen).tolist()
            engine.add_request(ids, params)
        tokens, seconds, steps = 0, 0.0, []
        while engine.has_unfinished_requests():
            _, stats = engine.step_with_stats()
            if stats is not None and stats.num_prefill_tokens == 0:
                tokens += stats.num_decode_tokens
                seconds += stats.duration
                steps.append(stats.duration)
        return batch / statistics.median(steps) if batch == 1 else tokens / seconds

    def prompt(seed: int) -> float:
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(10, vocab - 10, (prompt_len,), generator=gen).tolist()
        t = time.perf_counter()
        engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0))
        while engine.has_unfinished_requests():
            engine.step()
        return time.perf_counter() - t

    prompt(1)  # warm
    out = {
        "load_s": load_s,
        "batch1_tok_s": decode(1, 2),
        "prompt_s": min(prompt(3), prompt(4)),
        "streams_tok_s": decode(streams, 5),
    }
    out["peak_rss_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6
    return out


def run_quill(path: Path, args) -> dict:
    cmd = [sys.executable, __file__, "--quill-side", str(path), "--streams", str(args.streams),
           "--new-tokens", str(args.new_tokens), "--prompt-len", str(args.prompt_len),
           "--threads", str(args.threads)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"quill side failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- llama.cpp's side ----------------------------------------------------------------------------


def _peak_rss_of(cmd: list[str]) -> tuple[float, str]:
    """Runs cmd; its own peak RSS (GB, from wait4) and its output."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{out[-2000:]}")
    return usage.ru_maxrss / 1e6, out


def run_llama(path: Path, args) -> dict:
    kw = dict(threads=args.threads, repetitions=1)
    decode = llama_cpp.bench_decode(path, n_gen=args.new_tokens, **kw)
    prompt = llama_cpp.bench_prompt(path, (args.prompt_len,), **kw)
    ctx = kv_tokens(args.streams, args.new_tokens)
    cmd = [str(llama_cpp.binary("llama-batched-bench")), "-m", str(path), "-t", str(args.threads),
           "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(PROMPT),
           "-ntg", str(args.new_tokens), "-npl", str(args.streams), "-fa", "on"]  # fmt: skip
    t = time.perf_counter()
    rss, out = _peak_rss_of(cmd)
    wall = time.perf_counter() - t
    row = [line for line in out.splitlines() if re.match(rf"^\|\s*{PROMPT}\s*\|", line)]
    cells = [c.strip() for c in row[-1].strip("|").split("|")]
    t = time.perf_counter()
    server = llama_cpp.start_server(path, threads=args.threads, ctx=ctx, parallel=args.streams)
    load_s = time.perf_counter() - t
    server.stop()
    return {
        "load_s": load_s,
        "batch1_tok_s": decode["tokens_per_s"],
        "prompt_s": prompt[args.prompt_len]["seconds"],
        "streams_tok_s": float(cells[7]),  # S_TG t/s
        "peak_rss_gb": rss,
        "batched_wall_s": wall,
    }


# --- the run -------------------------------------------------------------------------------------


def best(results: list[dict], key: str, lower: bool = False):
    values = [r[key] for r in results if r.get(key) is not None]
    if not values:
        return None
    return min(values) if lower else max(values)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="*")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", default=None)
    parser.add_argument("--quill-side", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quill_side:
        sizes = (args.streams, args.new_tokens, args.prompt_len, args.threads)
        print(json.dumps(quill_side(args.quill_side, *sizes)))
        return
    from benchmarks.engine.machine import machine_info

    info = machine_info(args.threads)
    print(json.dumps(info))
    table = {}
    for spec in args.files:
        path = resolve(spec)
        runs = {"quill": [], "llama.cpp": []}
        for r in range(args.rounds):
            order = ("quill", "llama.cpp") if r % 2 == 0 else ("llama.cpp", "quill")
            for side in order:
                result = run_quill(path, args) if side == "quill" else run_llama(path, args)
                runs[side].append(result)
                print(spec, r, side, json.dumps(result), flush=True)
        q, ll = runs["quill"], runs["llama.cpp"]
        row = {}
        for key, lower in (("batch1_tok_s", False), ("streams_tok_s", False), ("prompt_s", True),
                           ("load_s", True), ("peak_rss_gb", True)):  # fmt: skip
            row[key] = (best(q, key, lower), best(ll, key, lower))
        table[spec] = {"file": str(path), "size_gb": path.stat().st_size / 1e9, "figures": row,
                       "runs": runs}  # fmt: skip
    print()
    print(f"| file | batch 1 tok/s (x) | {args.streams} streams tok/s (x) | "
          f"{args.prompt_len}-token prompt s (x) | peak RSS GB (x) | load s |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for spec, entry in table.items():
        f = entry["figures"]

        def cell(key, inverse=False, f=f):
            a, b = f[key]
            if a is None or b is None:
                return f"{a} / {b}"
            ratio = b / a if inverse else a / b
            return f"{a:.2f} / {b:.2f} ({ratio:.2f}x)"

        load_q, load_l = f["load_s"]
        load = f"{load_q:.1f} / {load_l:.1f}"
        print(f"| {spec} ({entry['size_gb']:.2f} GB) | {cell('batch1_tok_s')} | "
              f"{cell('streams_tok_s')} | {cell('prompt_s', True)} | {cell('peak_rss_gb')} | "
              f"{load} |")  # fmt: skip
    if args.json:
        everything = {"machine": info, "args": vars(args), "table": table}
        Path(args.json).write_text(json.dumps(everything, indent=2))


if __name__ == "__main__":
    main()
