"""Scoring prompts (prompt logprobs) against the same prompts' plain prefill, in one engine.

Why: an evaluation harness scores a batch of prompts, and scoring is a prefill that also maps
every prompt row through the output head (quill/model/prompt_logprobs.py). The target is its
throughput in prompt tokens/s within 10% of the plain prefill of the same prompts.

Sides, taking turns round after round in one LLM (the order rotating each round), each keeping
its best round: `prefill` (max_tokens 0: the prompts computed, nothing sampled or scored),
`score` (max_tokens 0, prompt_logprobs `--top-n`, 1 by default as lm-evaluation-harness asks),
and with `--with-first-token` also `prefill+1` (max_tokens 1: what a plain request's prefill
costs with its first token). Prefix caching is off, so no round reuses another's blocks.

The roofline beside the measurement: the cost model's FLOPs of each side's steps (the engine's
own plans, priced by quill.cost), whose ratio is the least the scoring side can cost more, and
a breakdown of the head's share: the output head's matmul alone over the same rows, timed
against the whole scoring reduction (head, logsumexp, the token's logit, rank, top n).

Usage:
    .venv/bin/python benchmarks/bench_scoring.py [--prompts 32] [--prompt-len 512]
        [--rounds 3] [--top-n 1] [--dtype auto|float32|bfloat16] [--with-first-token]
        [--json docs/results/bench_scoring.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_server import finish_results  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.cost.batch import BatchShape  # noqa: E402
from quill.model.prompt_logprobs import score_rows  # noqa: E402

TEXT = (
    "The harbour town woke slowly that morning. Fishing boats rocked against the pier while "
    "gulls argued over scraps, and the baker on the corner set out trays of bread that steamed "
    "in the cold air. Children ran along the sea wall towards the school, where a bell rang "
    "twice, and an old man mended nets in the sun, humming a tune nobody else remembered. "
)


def make_prompts(llm: LLM, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens (each starts with its own number)."""
    tok = llm.tokenizer
    body = tok.encode(TEXT * (length // 40 + 2))
    return [(tok.encode(f"Story {i}: ") + body)[:length] for i in range(count)]


class FlopCounter:
    """Sums the cost model's FLOPs of every step the engine runs (a step listener)."""

    def __init__(self, llm: LLM) -> None:
        self.cost_model = llm.engine.accountant.cost_model if llm.engine.accountant else None
        self.model = llm.engine.accountant.model
        self.flops = 0.0

    def on_step(self, plan, start, end) -> None:
        shape = BatchShape.from_plan(plan)
        self.flops += self.model.linear_flops(shape.num_tokens, shape.num_sampled)
        self.flops += self.model.attention_flops(shape.attention_pairs)


def run_side(llm: LLM, prompts, params: SamplingParams, counter: FlopCounter) -> dict:
    counter.flops = 0.0
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - start
    tokens = sum(len(p) for p in prompts)
    if params.prompt_logprobs is not None:
        assert all(len(o.prompt_logprobs) == len(p) for o, p in zip(outs, prompts))
    return {"wall_s": wall, "prompt_tokens_per_s": tokens / wall, "flops": counter.flops}


def head_breakdown(llm: LLM, rows: int, top_n: int, repeats: int = 5) -> dict:
    """The output head's matmul over `rows` rows, against the whole scoring reduction."""
    model = llm.engine.runner.model
    config = llm.engine.model_config
    hidden = torch.randn(rows, config.hidden_size, dtype=llm.engine.dtype)
    targets = torch.randint(0, config.vocab_size, (rows,))

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    with torch.inference_mode():
        head = best(lambda: model.compute_logits(hidden))
        whole = best(
            lambda: score_rows(model.compute_logits, hidden, targets, top_n, config.vocab_size)
        )
    return {"rows": rows, "head_matmul_s": head, "score_rows_s": whole}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--top-n", type=int, default=1)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--with-first-token", action="store_true")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, enable_prefix_caching=False)
    counter = FlopCounter(llm)
    llm.engine.core.step_listeners.append(counter)
    prompts = make_prompts(llm, args.prompts, args.prompt_len)
    sides = {
        "prefill": SamplingParams(max_tokens=0),
        "score": SamplingParams(max_tokens=0, prompt_logprobs=args.top_n),
    }
    if args.with_first_token:
        sides["prefill+1"] = SamplingParams(max_tokens=1, temperature=0)
    run_side(llm, prompts[:2], sides["score"], counter)  # warm-up: first-call costs
    rounds: dict[str, list[dict]] = {name: [] for name in sides}
    names = list(sides)
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            result = run_side(llm, prompts, sides[name], counter)
            rounds[name].append(result)
            print(
                f"round {r} {name:>9}: {result['prompt_tokens_per_s']:8.1f} prompt tok/s "
                f"({result['wall_s']:.2f} s)",
                flush=True,
            )
    best = {name: max(rs, key=lambda x: x["prompt_tokens_per_s"]) for name, rs in rounds.items()}
    median = {
        n: statistics.median(x["prompt_tokens_per_s"] for x in rs) for n, rs in rounds.items()
    }
    ratio = best["score"]["prompt_tokens_per_s"] / best["prefill"]["prompt_tokens_per_s"]
    median_ratio = median["score"] / median["prefill"]
    flop_ratio = best["score"]["flops"] / best["prefill"]["flops"]
    breakdown = head_breakdown(
        llm, min(args.prompt_len, llm.engine.scheduler.token_budget), args.top_n
    )
    results = {
        "dtype": str(llm.engine.dtype),
        "weights": llm.engine.config.quantization,
        "token_budget": llm.engine.scheduler.token_budget,
        "num_prompts": args.prompts,
        "prompt_len": args.prompt_len,
        "rounds": rounds,
        "best": best,
        "median_prompt_tokens_per_s": median,
        "score_over_prefill": ratio,
        "score_over_prefill_median": median_ratio,
        "flops_score_over_prefill": flop_ratio,
        "head_breakdown": breakdown,
    }
    print(
        f"\nscore / prefill: {ratio:.3f} (median {median_ratio:.3f}); the cost model's FLOPs: "
        f"score / prefill {flop_ratio:.3f}, so at best {1 / flop_ratio:.3f} if time follows "
        f"FLOPs\nhead over {breakdown['rows']} rows: matmul {breakdown['head_matmul_s'] * 1e3:.1f}"
        f" ms, whole scoring {breakdown['score_rows_s'] * 1e3:.1f} ms"
    )
    finish_results(results, args)


if __name__ == "__main__":
    main()
