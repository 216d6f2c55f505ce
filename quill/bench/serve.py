"""`quill bench serve`: one benchmark run against an OpenAI-compatible server, end to end.

Ties the pieces together in the order a run needs them: find the model and the tokenizer,
make the prompts and the arrival times, send and time everything, then report (table, JSON,
figures). Every setting that shaped the numbers, the seed included, goes into the JSON so that
a run can be repeated exactly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import random
import sys

from quill.bench.datasets import (
    BenchRequest,
    random_requests,
    read_dataset,
    sample_requests,
)
from quill.bench.prompts import ExactPrompts, count_tokens, load_tokenizer
from quill.bench.report import format_table, write_json
from quill.bench.runner import Target, first_model, run_requests
from quill.bench.stats import summarize_run
from quill.bench.stream import ENDPOINT_PATHS
from quill.sim.workload import LengthSpec, arrival_times

DEFAULT_OUTPUT_LEN = LengthSpec(128, 128)


def _base_url(url: str) -> str:
    """The server's root: users often paste the OpenAI base URL, which ends in /v1."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _requests(args: argparse.Namespace, tokenizer, seed: int) -> list[BenchRequest]:
    if args.dataset == "random":
        prompts = ExactPrompts(tokenizer)
        output_len = args.output_len or DEFAULT_OUTPUT_LEN
        return random_requests(
            args.num_prompts, args.input_len, output_len, prompts, seed, args.random_prefix_len
        )
    entries = read_dataset(args.dataset)
    return sample_requests(
        entries,
        args.num_prompts,
        args.output_len,
        seed,
        count_prompt=lambda text: count_tokens(tokenizer, text),
        count_reply=lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids),
    )


def resolve_seed(seed: int | None) -> int:
    """The seed given, or a fresh one from the OS: prompts then differ from every earlier
    run's (no prefix cache can serve them), and the JSON still records how to repeat it."""
    return seed if seed is not None else random.SystemRandom().randrange(2**32)


def bench_serve(args: argparse.Namespace) -> int:
    """Run the benchmark `args` describe; 0 when any request succeeded, 1 when none did, 2
    when the run could not start (no model listed, no tokenizer, a bad dataset)."""
    # httpx logs every request at INFO: a line per request would bury the progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or None
    seed = resolve_seed(args.seed)
    base_url = _base_url(args.base_url)
    try:
        model = args.model or asyncio.run(first_model(base_url, api_key))
        tokenizer = load_tokenizer(args.tokenizer)
        requests = _requests(args, tokenizer, seed)
    except (ValueError, OSError) as e:
        print(f"quill bench serve: {e}", file=sys.stderr)
        return 2
    offsets = list(arrival_times(len(requests), args.request_rate, args.burstiness, seed))
    target = Target(
        base_url,
        model,
        args.endpoint,
        api_key,
        args.ignore_eos,
        args.timeout,
        args.max_concurrency,
    )

    from tqdm import tqdm

    show = sys.stderr.isatty() if args.progress is None else args.progress
    with tqdm(total=len(requests), unit="req", disable=not show) as bar:
        records, duration = asyncio.run(
            run_requests(
                target,
                requests,
                offsets,
                count_text=lambda text: len(tokenizer.encode(text, add_special_tokens=False).ids),
                on_done=lambda _: bar.update(1),
            )
        )
    summary = summarize_run(records, duration, args.slo)
    rate = args.request_rate
    settings = {
        "url": base_url + ENDPOINT_PATHS[args.endpoint],
        "base_url": base_url,
        "endpoint": args.endpoint,
        "model": model,
        "num_prompts": args.num_prompts,
        "request_rate": rate if math.isfinite(rate) else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        "dataset": str(args.dataset),
        "input_len": str(args.input_len) if args.dataset == "random" else None,
        "random_prefix_len": args.random_prefix_len if args.dataset == "random" else None,
        "output_len": str(args.output_len) if args.output_len else None,
        "ignore_eos": args.ignore_eos,
        "tokenizer": str(args.tokenizer) if args.tokenizer else "default model's",
        "seed": seed,
        "seed_given": args.seed is not None,
        "timeout_s": args.timeout,
    }
    print(format_table(summary, settings))
    mismatched = [
        r
        for r in records
        if r.ok and r.prompt_tokens is not None and r.prompt_tokens != r.prompt_len
    ]
    if args.endpoint == "completions" and mismatched:
        print(
            f"note: for {len(mismatched)} requests the server counted other prompt lengths than "
            "the tokenizer used here: pass the served model's tokenizer with --tokenizer",
            file=sys.stderr,
        )
    if args.out:
        write_json(args.out, settings, summary, records)
        print(f"wrote {args.out}")
    if args.plot:
        from quill.bench.plots import write_plots

        for path in write_plots(args.plot, records):
            print(f"wrote {path}")
    return 0 if summary["completed"] else 1
