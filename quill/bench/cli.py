"""`quill bench`: the command line of the benchmark client (`quill bench serve`) and of the
experiments (`quill bench experiments`, parsed in quill.bench.experiments.cli).

Only argument parsing lives here, importing nothing heavy, so that `quill --help` stays quick;
the run itself is quill.bench.serve.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from quill import argtypes
from quill.sim.metrics import SLO
from quill.sim.workload import LengthSpec

DESCRIPTION = """\
Benchmark an OpenAI-compatible server (quill, vLLM, llama.cpp's llama-server): send
--num-prompts streamed requests at --request-rate and report the wait for the first token
(TTFT) apart from the pace of the following ones (TPOT, ITL), end-to-end latency, throughput
and goodput. Random prompts are made with the tokenizer so that they encode to exactly
--input-len tokens (a BOS the tokenizer adds included), different on every run unless --seed
is given, so that no prefix cache flatters the numbers."""

EPILOG = """\
how it measures:
  Every request streams, asking for usage in every chunk (stream_options include_usage and
  continuous_usage_stats); every chunk is timestamped when it arrives. TTFT: from sending to
  the first chunk carrying text. ITL: the gaps between chunks carrying text, over all
  requests; a chunk that carries several tokens gives one gap (as vLLM's benchmark counts
  it), so ITL is the pace a reader sees, and TPOT = (e2e - TTFT) / (output tokens - 1) is the
  pace per token. e2e ends at [DONE].
  Output tokens come from the server's usage, else from logprob entries or llama-server's
  timings.predicted_n, else from the client tokenizing the text (the table says which).
  Input tokens are the server's prompt_tokens when it reports usage: for --endpoint chat,
  responses and messages they include the chat template's tokens around the prompt. The
  Responses and Messages APIs stream their own events (text deltas timed as chunks) and end
  with their last event instead of [DONE]; their usage comes at the end.
  A failed request (refused connection, error status, error event, stream cut short, a
  reply with no text, --timeout) is reported with its reason; the run goes on.
  Percentiles interpolate linearly between ranks (numpy's default). The itl objective of
  --slo is held against each request's TPOT.

datasets (--dataset FILE): a JSON list or JSONL of ShareGPT conversations
  {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", "value": ...}]}
  or of {"prompt": ..., "output_len": N} (output_len optional). The first human turn is the
  prompt; the first gpt reply's token count is the output length unless --output-len is set.

exit status: 0 when some request succeeded, 1 when none did, 2 when the run could not start."""


def _dataset(text: str) -> str | Path:
    if text == "random":
        return text
    path = Path(text)
    if not path.is_file():
        raise ValueError(f"no such file: {text!r} (or use 'random')")
    return path


def add_serve_bench_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:8000", help="server root (default: %(default)s)")
    add("--model", default=None, help="model name (default: the first of GET /v1/models)")
    add("--endpoint", choices=("completions", "chat", "responses", "messages"),
        default="completions")  # fmt: skip
    add("--num-prompts", type=argtypes.checked(argtypes.positive_int, "num-prompts"), default=100)
    add(
        "--request-rate",
        type=argtypes.checked(argtypes.rate, "request-rate"),
        default=math.inf,
        help="requests per second, Poisson arrivals (inf, the default: all at once)",
    )
    add(
        "--burstiness",
        type=argtypes.checked(argtypes.positive, "burstiness"),
        default=1.0,
        help="gamma shape of the inter-arrival times, mean kept at 1/rate: 1 is Poisson, "
        "below 1 burstier, above 1 more even",
    )
    add(
        "--max-concurrency",
        type=argtypes.checked(argtypes.positive_int, "max-concurrency"),
        default=None,
        help="at most N requests in flight; the others wait in the client",
    )
    add(
        "--input-len",
        type=argtypes.checked(LengthSpec.parse, "input-len"),
        default=LengthSpec(1024, 1024),
        help="prompt tokens for --dataset random: N, or MIN:MAX uniform (default: 1024)",
    )
    add(
        "--random-prefix-len",
        type=argtypes.checked(argtypes.non_negative_int, "random-prefix-len"),
        default=0,
        help="for --dataset random: every prompt starts with the same N random tokens (a "
        "shared system prompt, say), then its --input-len own (default: 0)",
    )
    add(
        "--output-len",
        type=argtypes.checked(LengthSpec.parse, "output-len"),
        default=None,
        help="max_tokens: N or MIN:MAX (default: 128, or the dataset's lengths)",
    )
    add(
        "--dataset",
        type=argtypes.checked(_dataset, "dataset"),
        default="random",
        help="random or FILE",
    )
    add("--ignore-eos", action="store_true", help="generate max_tokens tokens whatever comes")
    add(
        "--tokenizer",
        type=Path,
        default=None,
        help="local tokenizer.json or model directory (default: the default model's)",
    )
    add(
        "--slo", type=argtypes.checked(SLO.parse, "slo"), default=None, help="ttft=MS,itl=MS,e2e=MS"
    )
    add("--seed", type=int, default=None, help="fixes prompts, lengths and arrivals")
    add("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY)")
    add("--timeout", type=argtypes.checked(argtypes.positive, "timeout"), default=600.0,
        help="seconds one request may take in all (default: %(default)g)")  # fmt: skip
    add("--out", type=Path, default=None, help="write every request's timings here (JSON)")
    add("--plot", type=Path, default=None, help="write TTFT/ITL CDFs and a timeline here")
    add(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal)",
    )


def _run_serve_bench(args: argparse.Namespace) -> int:
    from quill.bench.serve import bench_serve

    return bench_serve(args)


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register `bench` (`bench serve`, `bench experiments`) on the `quill` command's
    subparsers."""
    parser = subparsers.add_parser("bench", help="benchmark clients")
    commands = parser.add_subparsers(dest="bench_command", required=True)
    serve = commands.add_parser(
        "serve",
        help="benchmark an OpenAI-compatible server",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_bench_arguments(serve)
    serve.set_defaults(func=_run_serve_bench)
    from quill.bench.experiments.cli import add_experiments_parser

    add_experiments_parser(commands)
    return parser
