"""The peer columns of the engine benchmark: transformers and llama.cpp on the same model.

Each offers the quill column's measurements (prefill, decode, bench_decode, long_decode) with
the same arguments and result keys, so the run alternates all columns alike.
"""

from __future__ import annotations

import inspect
import statistics
import time
from pathlib import Path

import torch

from benchmarks.peers import llama_cpp

from .variants import GGUF_CLASS, TORCH_CLASS, prompt_ids

# --- transformers --------------------------------------------------------------------------------


class HFColumn:
    kind = "hf"

    def __init__(self, dtype: torch.dtype, model: Path):
        """`model`: a Hugging Face directory, or a GGUF file (transformers dequantizes it)."""
        from transformers import AutoModelForCausalLM

        self.dtype = dtype
        self.precision = TORCH_CLASS.get(dtype, str(dtype))
        self.name = f"transformers-{self.precision}"
        if model.suffix == ".gguf":
            where = dict(pretrained_model_name_or_path=str(model.parent), gguf_file=model.name)
        else:
            where = dict(pretrained_model_name_or_path=str(model))
        self.model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype)
        self.model.eval()
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        # transformers 5 renamed past_key_values to cache (the old name warns, then goes).
        params = inspect.signature(self.model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"
        self.prefill(64, 99)

    def prefill(self, n: int, seed: int) -> dict:
        ids = torch.tensor([prompt_ids(n, seed)])
        with torch.inference_mode():
            t = time.perf_counter()
            self.model(ids, logits_to_keep=1)
            return {"seconds": time.perf_counter() - t}

    def decode(self, batch: int, prompt: int, new_tokens: int) -> dict:
        ids = torch.tensor([prompt_ids(prompt, 1000 + i) for i in range(batch)])
        with torch.inference_mode():
            t = time.perf_counter()
            self.model(ids, logits_to_keep=1)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
            total = time.perf_counter() - t
        step_s = max(total - prefill, 1e-9) / max(new_tokens - 1, 1)
        return {
            "step_ms": 1000 * step_s,
            "tokens_per_s": batch * new_tokens / total,
            "decode_tokens_per_s": batch / step_s,
        }

    def bench_decode(self, new_tokens: int) -> dict:
        """One sequence, a 1-token prompt, decode only: what llama-bench's tg measures."""
        d = self.decode(1, 1, new_tokens)
        return {"step_ms": d["step_ms"], "decode_tokens_per_s": d["decode_tokens_per_s"]}

    def long_decode(self, batch: int, context: int, new_tokens: int, chunk: int = 256) -> dict:
        """Prefill in chunks of `chunk` tokens (bounded attention scratch), then time decode."""
        ids = torch.tensor([prompt_ids(context, 2000 + i) for i in range(batch)])
        with torch.inference_mode():
            past = None
            for start in range(0, context, chunk):
                out = self.model(
                    ids[:, start : start + chunk],
                    use_cache=True,
                    logits_to_keep=1,
                    **{self.cache_kw: past},
                )
                past = getattr(out, self.cache_kw)
            token = out.logits[:, -1:].argmax(-1)
            times = []
            for _ in range(new_tokens):
                t = time.perf_counter()
                out = self.model(token, use_cache=True, **{self.cache_kw: past})
                past = getattr(out, self.cache_kw)
                token = out.logits[:, -1:].argmax(-1)
                times.append(time.perf_counter() - t)
        del past, out
        return {
            "step_ms": 1000 * statistics.median(times),
            "decode_tokens_per_s": batch * len(times) / sum(times),
            "context": context + (new_tokens - 1) / 2,
        }


# --- llama.cpp -----------------------------------------------------------------------------------


class LlamaColumn:
    kind = "llama"

    def __init__(self, gguf: str | Path, threads: int, repetitions: int):
        """`gguf`: one of the default model's GGUF types (f32, q8_0, ...), or a GGUF file."""
        self.lc = llama_cpp
        if isinstance(gguf, Path):
            self.model = gguf
            gguf_type = gguf.stem.rsplit("-", 1)[-1].lower()  # gemma-3-270m-q4_k_m: q4_k_m
        else:
            self.model = self.lc.model_path(gguf)
            gguf_type = gguf
        self.threads = threads
        self.repetitions = repetitions
        self.precision = GGUF_CLASS.get(gguf_type, gguf_type)
        self.name = f"llama.cpp-{gguf_type}"
        self.weight_bytes = self.model.stat().st_size

    def prefill(self, n: int, seed: int) -> dict:
        res = self.lc.bench_prompt(
            self.model, (n,), threads=self.threads, repetitions=self.repetitions
        )
        return {"seconds": res[n]["seconds"]}

    def _batched(self, batch: int, prompt: int, new_tokens: int) -> dict:
        return self.lc.batched_bench(
            self.model, npp=prompt, ntg=new_tokens, npl=(batch,), threads=self.threads
        )[batch]

    def decode(self, batch: int, prompt: int, new_tokens: int) -> dict:
        r = self._batched(batch, prompt, new_tokens)
        return {
            "step_ms": r["step_ms"],
            "tokens_per_s": r["tokens_per_s"],
            "decode_tokens_per_s": r["decode_tokens_per_s"],
        }

    def long_decode(self, batch: int, context: int, new_tokens: int) -> dict:
        r = self._batched(batch, context, new_tokens)
        return {
            "step_ms": r["step_ms"],
            "decode_tokens_per_s": r["decode_tokens_per_s"],
            "context": context + (new_tokens - 1) / 2,
        }

    def bench_decode(self, new_tokens: int) -> dict:
        r = self.lc.bench_decode(
            self.model, new_tokens, threads=self.threads, repetitions=self.repetitions
        )
        return {"step_ms": r["step_ms"], "decode_tokens_per_s": r["tokens_per_s"]}
