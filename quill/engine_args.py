"""The engine's command-line flags, shared by every command that builds an engine.

Kept apart from `quill.cli` so that the server (and the simulator) can take the same flags
without importing the command dispatcher that imports them.
"""

from __future__ import annotations

import argparse
import os

from quill.argtypes import checked, positive, rate
from quill.config import QUANTIZATIONS, TASKS, SchedulingPolicy


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--task",
        choices=TASKS,
        default="auto",
        help="what the model is served for: generate, embed, or score (a decoder reranker such "
        "as Qwen3-Reranker: its yes / no logits); auto: embed for an encoder, else generate",
    )
    parser.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda")
    parser.add_argument("--load-format", default="auto", help="auto | safetensors | gguf | dummy")
    add_scheduler_arguments(parser)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        metavar="N",
        help="split every layer over N ranks (processes; torch.distributed, gloo on the CPU)",
    )
    parser.add_argument(
        "--nnodes", type=int, default=1, help="hosts the ranks spread over (default 1)"
    )
    parser.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this host's index: 0 serves (with rank 0), the others run `quill tp-node`",
    )
    parser.add_argument(
        "--master-addr",
        default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
        help="rank 0's host, as the other hosts reach it (default $MASTER_ADDR or 127.0.0.1)",
    )
    parser.add_argument(
        "--master-port",
        type=int,
        default=int(os.environ["MASTER_PORT"]) if os.environ.get("MASTER_PORT") else None,
        help="rank 0's port for the group (default $MASTER_PORT; one host: a free port)",
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile (slow start)")
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=QUANTIZATIONS,
        help="weight-only quantization; auto keeps int8 for the batch sizes where it measures "
        "faster on this machine",
    )
    parser.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help='speculative decoding, as vLLM\'s dict: \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\'; on '
        'only in steps where the cost model says it pays (add "by_cost": false for always)',
    )
    parser.add_argument(
        "--record-steps",
        default=None,
        metavar="FILE",
        help="append every step's composition and wall time to FILE (JSONL)",
    )
    parser.add_argument(
        "--cost-accounting",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="charge every request its FLOPs, bytes moved and (with a price) dollars, and price "
        "every step on the cost model (off: no per-step cost)",
    )
    parser.add_argument(
        "--hardware",
        default=None,
        help="cost model hardware: a preset or a `quill cost calibrate` file "
        "(default: this machine's saved calibration, if any)",
    )
    parser.add_argument(
        "--calibration",
        choices=("refit", "refuse", "as-is"),
        default=None,
        help="when this machine's saved calibration is stale (another native build, CPU, torch "
        "or weight formats): refit it once with a quick sweep (the default), refuse to start "
        "(naming the command), or use it as it is (default: $QUILL_CALIBRATION, else refit)",
    )
    parser.add_argument(
        "--price-per-hour", type=float, default=None, help="USD per hour, to price requests"
    )
    parser.add_argument(
        "--scheduling-policy",
        default="fcfs",
        choices=[p.value for p in SchedulingPolicy],
        help="fcfs: arrival order; priority: lower `priority` of a request first (default fcfs)",
    )
    parser.add_argument(
        "--priority-aging",
        type=checked(rate, "seconds"),
        default=10.0,
        metavar="SECONDS",
        help="under the priority policy a waiting request gains one level per SECONDS waited, "
        "which bounds its wait; inf: strict priority, a low one can wait forever (default 10)",
    )
    parser.add_argument(
        "--max-ttft-slo",
        type=checked(positive, "milliseconds"),
        default=None,
        metavar="MS",
        help="refuse at once (503, Retry-After) a request whose predicted time to first token "
        "exceeds MS milliseconds, instead of queuing it to time out",
    )
    parser.add_argument(
        "--predict-ttft",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="predict every request's time to first token as it arrives (reported beside the "
        "actual one; needed by --max-ttft-slo and per-request ttft_slo_ms)",
    )

    kv = parser.add_argument_group("disaggregation (quill serve --role, quill router)")
    kv.add_argument(
        "--kv-transfer-port",
        type=int,
        default=None,
        help="a prefill instance's KV address port, where decode instances fetch prompt KV "
        "(default with --role prefill: the HTTP port + 1)",
    )
    kv.add_argument(
        "--kv-transfer-host", default="127.0.0.1", help="the KV address's host (default local)"
    )
    kv.add_argument(
        "--kv-transfer-timeout",
        type=checked(positive, "seconds"),
        default=30.0,
        metavar="SECONDS",
        help="longest a KV transfer (or pairing with a prefill instance) may take (default 30)",
    )
    kv.add_argument(
        "--kv-transfer-failure",
        choices=("recompute", "fail"),
        default="recompute",
        help="a decode instance whose KV fetch fails: computes the prompt itself (default), or "
        "fails the request",
    )

    routing = parser.add_argument_group("routing (quill router, and the routers of other stacks)")
    routing.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish KV-cache events for prefix-aware routers, as vLLM's JSON: "
        '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", "replay_endpoint": '
        '"tcp://*:5558", "topic": "kv-events"}\' (ZeroMQ PUB; msgpack batches in vLLM\'s '
        "format; block hashes documented in quill/engine/kv_events.py)",
    )
    routing.add_argument(
        "--data-parallel-rank",
        type=int,
        default=0,
        help="this replica's index among data-parallel ones (offsets the KV-event ports)",
    )


def add_scheduler_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags the scheduler reads; the simulator takes exactly these too."""
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=None, help="bytes (e.g. 2GiB, 512MiB)"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="how the KV cache is stored: auto | float32 | bfloat16 | float16 | int8 (codes "
        "with an fp16 scale per 32 dimensions: half the bytes), or K,V apart (e.g. "
        "bfloat16,int8); auto: 16-bit (the model's dtype if 16-bit, else bf16 where the CPU "
        "has bf16 arithmetic, fp16 where not)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV cache of full blocks of earlier prompts (default on)",
    )


def engine_options(args: argparse.Namespace) -> dict:
    return dict(
        task=args.task,
        dtype=args.dtype,
        device=args.device,
        load_format=args.load_format,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        kv_cache_memory=args.kv_cache_memory,
        block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype,
        compile=args.compile,
        quantization=args.quantization,
        record_steps=args.record_steps,
        speculative_config=args.speculative_config,
        hardware=args.hardware,
        calibration=args.calibration,
        price_per_hour=args.price_per_hour,
        enable_prefix_caching=args.enable_prefix_caching,
        scheduling_policy=args.scheduling_policy,
        priority_aging=args.priority_aging,
        max_ttft_slo=None if args.max_ttft_slo is None else args.max_ttft_slo / 1000,
        predict_ttft=args.predict_ttft,
        tensor_parallel_size=args.tensor_parallel_size,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        cost_accounting=args.cost_accounting,
        kv_transfer_host=args.kv_transfer_host,
        kv_transfer_port=args.kv_transfer_port,
        kv_transfer_timeout=args.kv_transfer_timeout,
        kv_transfer_failure=args.kv_transfer_failure,
        kv_events_config=args.kv_events_config,
        data_parallel_rank=args.data_parallel_rank,
    )


def parse_bytes(text: str) -> int:
    """'2GiB', '512MiB', '1.5GB' or a plain number of bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lower = text.strip().lower()
    try:
        for suffix, scale in units.items():
            if lower.endswith(suffix):
                return int(float(lower[: -len(suffix)]) * scale)
        return int(float(lower))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r}") from None
