"""What quill's int8 KV cache costs in accuracy (issue 44), measured on the engine itself: each
`--kv-cache-dtype` against the 16-bit (bf16) cache, the weights the same (fp32, not quantized).

Over the chat prompts of `benchmarks/prompts/spec_chat.json` in the model's template: the bf16
cache's greedy continuation (64 tokens) is scored teacher-forced by each cache (prompt
logprobs over prompt + continuation: mean and largest absolute difference of the
continuation's token logprobs; the share of positions whose most likely token is the same),
and each cache's own greedy continuation is compared position by position (the share of the
64 x prompts tokens that agree, and the mean count before the first difference). fp32 KV is
in the table as the scale: what 16-bit itself moves.

    .venv/bin/python benchmarks/kv_int8_quality.py [--model DIR|GGUF] [--tokens 64]
        [--caches float32,int8,bfloat16,int8,...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine.machine import machine_info  # noqa: E402

REFERENCE = "bfloat16"


def chat_prompts(model: str, count: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    path = Path(model)
    where = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent) if where else model, **where)
    chats = json.loads((Path(__file__).parent / "prompts" / "spec_chat.json").read_text())[:count]
    if tokenizer.chat_template:
        texts = [
            tokenizer.apply_chat_template(c["messages"], add_generation_prompt=True, tokenize=False)
            for c in chats
        ]
        return [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    return [tokenizer.encode(c["messages"][-1]["content"]) for c in chats]


def run_cache(model: str, kv: str, prompts, tokens: int, reference):
    """Greedy continuations, and (given the reference's) their teacher-forced scores."""
    from quill import LLM, SamplingParams

    llm = LLM(model, dtype="float32", kv_cache_dtype=kv, quantization="none", max_num_seqs=16)
    greedy = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    own = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    scored = None
    if reference is not None:
        score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        full = [p + c for p, c in zip(prompts, reference, strict=True)]
        outs = llm.generate(full, score, use_tqdm=False)
        scored = []
        for p, c, o in zip(prompts, reference, outs, strict=True):
            rows = o.prompt_logprobs[len(p) : len(p) + len(c)]  # the token's and the top one's
            chosen = [row[t] for row, t in zip(rows, c, strict=True)]
            scored.append((chosen, [max(row, key=row.get) for row in rows]))
    del llm
    return own, scored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="a Hugging Face directory or a GGUF file")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--caches", default="float32,int8,bfloat16;int8,int8;bfloat16")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.model is None:
        from quill.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    prompts = chat_prompts(args.model, args.prompts)
    start = time.perf_counter()
    reference, _ = run_cache(args.model, REFERENCE, prompts, args.tokens, None)
    # The reference scores its own continuation too: the teacher-forced baseline.
    _, ref_scored = run_cache(args.model, REFERENCE, prompts, args.tokens, reference)
    total = sum(len(c) for c in reference)
    print("| KV cache | mean abs logprob diff | max | argmax agreement (teacher-forced) | "
          "greedy agreement (free-running) | tokens before the first difference |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    results = []
    for kv in args.caches.split(","):
        kv = kv.replace(";", ",")
        own, scored = run_cache(args.model, kv, prompts, args.tokens, reference)
        diffs, agree = [], 0
        for (lp, top), (ref_lp, ref_top) in zip(scored, ref_scored, strict=True):
            diffs += [abs(a - b) for a, b in zip(lp, ref_lp, strict=True)]
            agree += sum(a == b for a, b in zip(top, ref_top, strict=True))
        free = sum(a == b for o, c in zip(own, reference) for a, b in zip(o, c))
        first = [next((i for i, (a, b) in enumerate(zip(o, c)) if a != b), len(c))
                 for o, c in zip(own, reference)]  # fmt: skip
        row = {
            "kv_cache_dtype": kv,
            "mean_abs_logprob_diff": sum(diffs) / len(diffs),
            "max_abs_logprob_diff": max(diffs),
            "teacher_forced_argmax_agreement": agree / total,
            "free_greedy_agreement": free / total,
            "mean_tokens_before_first_difference": sum(first) / len(first),
        }
        results.append(row)
        print(
            f"| {kv} | {row['mean_abs_logprob_diff']:.4f} | {row['max_abs_logprob_diff']:.3f} | "
            f"{100 * row['teacher_forced_argmax_agreement']:.1f}% | "
            f"{100 * row['free_greedy_agreement']:.1f}% | "
            f"{row['mean_tokens_before_first_difference']:.1f} |",
            flush=True,
        )
    info = machine_info(os.cpu_count() or 1)
    info["command"] = " ".join(sys.argv)
    print(f"{len(prompts)} prompts x {args.tokens} tokens, {time.perf_counter() - start:.0f} s")
    if args.json:
        out = {"machine": info, "model": args.model, "reference": REFERENCE, "tokens": args.tokens,
               "date": time.strftime("%Y-%m-%d"), "results": results}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
