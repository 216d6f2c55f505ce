"""What an 8-bit KV cache costs in accuracy, by format and scale granularity (issue 44's first
decision): the model run by transformers with its keys (after RoPE) and values rounded as a
cache of each kind would store them, against the same model with 16-bit (bf16) KV.

Each scheme replaces the attention's keys and values by their quantized-then-dequantized
values before the attention product (a custom transformers attention function around SDPA),
as a paged cache holding them would give them back, the current token's own included (the
rounding is applied to every key and value at every step, so a greedy run with transformers'
own cache of the exact values sees what a rounded cache holds; a block's scale there covers
the tokens written so far):

- `int8/token`: symmetric int8, one fp32 scale per (token, KV head): max |x| / 127;
- `int8/block16`: one scale per (16 tokens, KV head) (a cache block);
- `int8/group32`: one scale per (token, KV head, 32 dimensions) (llama.cpp's q8_0 KV);
- `fp8_e4m3` / `fp8_e5m2`: cast with no scale (vLLM's fp8 KV with its default scale of 1);
- `fp8_e4m3/token`: e4m3 with one scale per (token, KV head), max |x| / 448;
- `fp32 (no rounding)`: what the 16-bit reference itself moves, against exact keys and values;
- `int8/token K only` / `V only`: which of the two is the more sensitive.

Over the chat prompts of `benchmarks/prompts/spec_chat.json` in the model's template: the
16-bit run's greedy continuation (64 tokens) is scored teacher-forced by each scheme (mean and
max absolute difference of the continuation's token logprobs; the share of positions whose
argmax agrees), and each scheme's own greedy continuation is compared position by position.

    .venv/bin/python benchmarks/kv_quant_quality.py [--model DIR] [--tokens 64] [--json out]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.engine.machine import machine_info  # noqa: E402


def _int8(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    scale = x.abs().amax(dim=dims, keepdim=True) / 127
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale).round().clamp(-127, 127) * scale


def _blocks(x: torch.Tensor, size: int, fn) -> torch.Tensor:
    """fn over groups of `size` consecutive tokens ([batch, heads, tokens, dim])."""
    b, h, t, d = x.shape
    pad = -t % size
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad))
    out = fn(padded.view(b, h, (t + pad) // size, size, d))
    return out.view(b, h, t + pad, d)[:, :, :t]


def _fp8(x: torch.Tensor, dtype, per_token: bool) -> torch.Tensor:
    if not per_token:
        return x.to(dtype).to(x.dtype)
    scale = x.abs().amax(-1, keepdim=True) / torch.finfo(dtype).max
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    return (x / scale).to(dtype).to(x.dtype) * scale


def _groups(x: torch.Tensor, size: int) -> torch.Tensor:
    b, h, t, d = x.shape
    return _int8(x.view(b, h, t, d // size, size), (-1,)).view(b, h, t, d)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


SCHEMES = {  # name: (key rounding, value rounding), on [batch, kv heads, tokens, dim]
    "bf16 (reference)": (_bf16, _bf16),
    "int8/token": (lambda x: _int8(x, (-1,)), lambda x: _int8(x, (-1,))),
    "int8/block16": (
        lambda x: _blocks(x, 16, lambda b: _int8(b, (-2, -1))),
        lambda x: _blocks(x, 16, lambda b: _int8(b, (-2, -1))),
    ),
    "int8/group32": (lambda x: _groups(x, 32), lambda x: _groups(x, 32)),
    "fp8_e4m3": (
        lambda x: _fp8(x, torch.float8_e4m3fn, False),
        lambda x: _fp8(x, torch.float8_e4m3fn, False),
    ),
    "fp8_e4m3/token": (
        lambda x: _fp8(x, torch.float8_e4m3fn, True),
        lambda x: _fp8(x, torch.float8_e4m3fn, True),
    ),
    "fp8_e5m2": (
        lambda x: _fp8(x, torch.float8_e5m2, False),
        lambda x: _fp8(x, torch.float8_e5m2, False),
    ),
    "fp32 (no rounding)": (lambda x: x, lambda x: x),  # what 16 bits cost: the noise floor
    "int8/token K only": (lambda x: _int8(x, (-1,)), _bf16),
    "int8/token V only": (_bf16, lambda x: _int8(x, (-1,))),
}
_current = {"scheme": "bf16 (reference)"}


def _attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    round_k, round_v = SCHEMES[_current["scheme"]]
    return ALL_ATTENTION_FUNCTIONS["sdpa"](
        module, query, round_k(key), round_v(value), attention_mask, **kwargs
    )


@torch.inference_mode()
def _greedy(model, ids: list[int], n: int) -> list[int]:
    out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


@torch.inference_mode()
def _logprobs(model, ids: list[int], continuation: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    full = torch.tensor([ids + continuation])
    logits = model(full).logits[0, len(ids) - 1 : -1].float().log_softmax(-1)
    chosen = logits.gather(1, torch.tensor(continuation)[:, None])[:, 0]
    return chosen, logits.argmax(-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--model", default=None, help="a Hugging Face directory or a GGUF file (default model)"
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--json")
    args = parser.parse_args()
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer

    if args.model is None:
        from quill.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    AttentionInterface.register("quill_kv_rounding", _attention)
    path = Path(args.model)
    where = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
    source = str(path.parent) if where else str(path)
    model = AutoModelForCausalLM.from_pretrained(
        source, dtype=torch.float32, attn_implementation="quill_kv_rounding", **where
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(source, **where)
    chats = json.loads((Path(__file__).parent / "prompts" / "spec_chat.json").read_text())
    if tokenizer.chat_template:
        texts = [
            tokenizer.apply_chat_template(c["messages"], add_generation_prompt=True, tokenize=False)
            for c in chats[: args.prompts]
        ]
        prompts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    else:  # a base model: the user's words as a completion prompt
        prompts = [tokenizer.encode(c["messages"][-1]["content"]) for c in chats[: args.prompts]]
    start = time.perf_counter()
    _current["scheme"] = "bf16 (reference)"
    reference = [_greedy(model, p, args.tokens) for p in prompts]
    ref_scores = [_logprobs(model, p, c) for p, c in zip(prompts, reference)]
    results = []
    for name in SCHEMES:
        _current["scheme"] = name
        diffs, agree, total, free_agree = [], 0, 0, 0
        for p, cont, (ref_lp, ref_arg) in zip(prompts, reference, ref_scores):
            lp, arg = _logprobs(model, p, cont)
            diffs.append((lp - ref_lp).abs())
            agree += int((arg == ref_arg).sum())
            total += len(cont)
            own = _greedy(model, p, args.tokens)
            free_agree += sum(a == b for a, b in zip(own, cont))
        d = torch.cat(diffs)
        row = {
            "scheme": name,
            "mean_abs_logprob_diff": d.mean().item(),
            "max_abs_logprob_diff": d.max().item(),
            "teacher_forced_argmax_agreement": agree / total,
            "free_greedy_agreement": free_agree / total,
        }
        results.append(row)
        print(
            f"| {name} | {row['mean_abs_logprob_diff']:.4f} | {row['max_abs_logprob_diff']:.3f} "
            f"| {100 * row['teacher_forced_argmax_agreement']:.1f}% "
            f"| {100 * row['free_greedy_agreement']:.1f}% |",
            flush=True,
        )
    info = machine_info(torch.get_num_threads())
    info["command"] = " ".join(sys.argv)
    print(f"{len(prompts)} prompts x {args.tokens} tokens, {time.perf_counter() - start:.0f} s")
    if args.json:
        out = {"machine": info, "model": args.model, "tokens": args.tokens, "results": results}
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
