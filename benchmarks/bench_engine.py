"""Engine benchmark: quill against transformers and llama.cpp on the same model and machine.

Why: quill's speed only means something next to the engines people would use instead. This
measures, for quill in each precision variant, transformers (same weights, same dtype) and
llama.cpp (GGUF files of the same model, built by benchmarks/peers/build_llama_cpp.sh):

- decode: output tokens/s and decode step time for 1, 4, 16 and 64 concurrent sequences with
  32-token prompts and 128 new tokens;
- long-context decode: 16 and 64 sequences at 1,500 tokens of context (decode phase only),
  with the KV read rate of quill's steps next to the machine's weight-streaming rate;
- prompts: time to first token of a 512- and a 2000-token prompt.

The machine drifts (20% between minutes), so every measurement alternates the columns round
after round and keeps each one's best; run it on an otherwise idle machine (llama.cpp's spinning
threads slow down many-fold when another process shares the cores). Each fp32 quill variant
holds a KV pool of about 6 GB for the default long-context rows. Ratios quill/peer come out
as markdown tables; --plot draws tokens/s against batch size under a measured roofline. Usage:

    .venv/bin/python benchmarks/bench_engine.py [--quill-variants fp32,bf16,int8]
        [--llama-types f32,q8_0] [--skip-hf] [--skip-llama] [--json out.json] [--plot out.png]
    .venv/bin/python benchmarks/bench_engine.py --quick --quill-variants fp32   # smoke run
    .venv/bin/python benchmarks/bench_engine.py --model gemma3-270m   # another model (a named
        one, a GGUF file or a Hugging Face directory); llama.cpp runs a GGUF file as it is
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

# The parts live in benchmarks/engine/; the repo root on the path makes `benchmarks` importable
# however this script is started.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.engine.machine import (  # noqa: E402
    gemm_flops,
    kernel_rates,
    machine_info,
    matmul_params,
    read_probe_rate,
    weight_stream_rate,
)
from benchmarks.engine.measure import measure  # noqa: E402
from benchmarks.engine.peer_columns import HFColumn, LlamaColumn  # noqa: E402
from benchmarks.engine.quill_column import QuillColumn, long_slack  # noqa: E402
from benchmarks.engine.report import plot, print_tables  # noqa: E402
from benchmarks.engine.variants import parse_variant  # noqa: E402
from quill.config import EngineConfig  # noqa: E402
from quill.model.factory import model_path_of  # noqa: E402
from quill.model.loader import read_model_config  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quill-variants",
        default="default",
        help="e.g. default,fp32,bf16,int8,bf16+int8 ('default': LLM() as a user gets it)",
    )
    parser.add_argument(
        "--model", default=None, help="named model, GGUF file or HF directory (default: SmolLM2)"
    )
    parser.add_argument(
        "--llama-types",
        default="f32,q8_0",
        help="GGUF types of the default model: f32,bf16,q8_0,q4_1 (with --model: its GGUF file)",
    )
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--skip-llama", action="store_true")
    parser.add_argument("--batches", default="1,4,16,64")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt of the decode rows")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--prompts", default="512,2000", help="time-to-first-token prompts")
    parser.add_argument("--long-context", type=int, default=1500)
    parser.add_argument("--long-batches", default="16,64")
    parser.add_argument("--long-new-tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds; best kept")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--llama-reps", type=int, default=1, help="llama-bench -r")
    parser.add_argument("--kv-cache-memory", type=int, default=None, help="bytes per quill LLM")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--quick", action="store_true", help="short smoke run (a few minutes)")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="tokens/s against batch size, PNG")
    args = parser.parse_args()
    if args.quick:
        args.batches, args.new_tokens, args.prompts, args.rounds = "1,4", 16, "128", 1
        args.long_context, args.long_batches, args.long_new_tokens = 256, "4", 8
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",") if b]
    prompts = [int(p) for p in args.prompts.split(",") if p]
    long_batches = [int(b) for b in args.long_batches.split(",") if b]
    variants = [v.strip() for v in args.quill_variants.split(",") if v.strip()]
    llama_types = [t.strip() for t in args.llama_types.split(",") if t.strip()]
    started = time.perf_counter()

    # The KV pool holds the largest row: the long-context rows decode up to long_slack tokens
    # past their prompts. quill zeroes its pool, so it is sized per variant's KV element size.
    kv_tokens = max(
        [
            b * (args.long_context + args.long_new_tokens + long_slack(b, args.long_context, None))
            for b in long_batches
        ]
        + [b * (args.prompt_len + args.new_tokens) for b in batches]
        + [p + 16 for p in prompts]
    )
    model_path = model_path_of(EngineConfig(model=args.model))
    kv_per_token = read_model_config(model_path, "auto").kv_bytes_per_token
    quill_cols = []
    for v in variants:
        element = 2 if parse_variant(v).get("dtype") in ("bfloat16", "float16") else 4
        kv_memory = args.kv_cache_memory or max(
            1 << 28, int(1.1 * kv_tokens * kv_per_token * element) + (64 << 20)
        )
        print(f"loading quill {v} (KV pool {kv_memory / 2**30:.2f} GiB)", flush=True)
        quill_cols.append(QuillColumn(v, kv_memory, args.compile, args.model))
    cfg = quill_cols[0].llm.engine.model_config
    hf_cols = []
    if not args.skip_hf:
        dtypes = [c.dtype for c in quill_cols if "quantization" not in c.options]
        for dtype in dict.fromkeys(dtypes or [quill_cols[0].dtype]):
            hf_cols.append(HFColumn(dtype, model_path))
    llama_cols = []
    llama_info = None
    if not args.skip_llama and args.model is not None:
        if model_path.suffix != ".gguf":
            raise SystemExit(f"llama.cpp needs a GGUF file, not {model_path} (or --skip-llama)")
        llama_cols.append(LlamaColumn(model_path, args.threads, args.llama_reps))
    elif not args.skip_llama:
        for t in llama_types:
            llama_cols.append(LlamaColumn(t, args.threads, args.llama_reps))
        if llama_cols:
            llama_info = llama_cols[0].lc.build_info()
    columns = [*quill_cols, *hf_cols, *llama_cols]

    print("measuring the machine: weight streaming, read bandwidth and fp32 GEMM", flush=True)
    stream_bps = weight_stream_rate()
    probe_bps = read_probe_rate()
    flops = gemm_flops()
    params = matmul_params(cfg)
    print("measuring each product kernel on the output head's shape", flush=True)
    kernels = kernel_rates(cfg)
    results: dict = {
        "machine": machine_info(args.threads),
        "settings": {
            k: getattr(args, k)
            for k in (
                "model quill_variants llama_types batches prompt_len new_tokens prompts "
                "long_context "
                "long_batches long_new_tokens rounds llama_reps compile quick"
            ).split()
        },
        "llama_cpp": llama_info,
        "rates": {
            "weight_stream_Bps": stream_bps,
            "read_probe_Bps": probe_bps,
            "gemm_fp32_flops": flops,
            "matmul_params_per_token": params,
            "kernels": kernels,
        },
        "columns": {
            c.name: {
                "kind": c.kind,
                "precision": c.precision,
                "weight_bytes": c.weight_bytes,
                **({"options": c.options} if c.kind == "quill" else {}),
                **(
                    {"token_budget": c.llm.engine.scheduler.token_budget}
                    if c.kind == "quill"
                    else {}
                ),
            }
            for c in columns
        },
    }
    print(
        f"weight streaming {stream_bps / 1e9:.1f} GB/s, fp32 GEMM {flops / 1e9:.0f} GFLOP/s, "
        f"{params / 1e6:.1f} M matmul params per token",
        flush=True,
    )

    r = args.rounds
    for n in prompts:
        measure(columns, results, "prefill", n, r, "prefill", n, 0)
    for b in batches:
        measure(columns, results, "decode", b, r, "decode", b, args.prompt_len, args.new_tokens)
    if 1 in batches and llama_cols:
        measure(columns, results, "decode_only", 1, r, "bench_decode", args.new_tokens)
    for b in long_batches:
        measure(
            columns,
            results,
            "long_decode",
            b,
            r,
            "long_decode",
            b,
            args.long_context,
            args.long_new_tokens,
        )
    results["minutes"] = (time.perf_counter() - started) / 60

    print_tables(results, columns, prompts, batches, long_batches, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
        print(f"wrote {args.json}")
    if args.plot:
        plot(results, columns, batches, long_batches, args)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
