"""The quill column of the engine benchmark: quill's offline engine, driven step by step.

It times prompts (time to first token), decode of N sequences, and long-context decode steps
(with the KV bytes each step reads), the same measurements the peer columns make.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from quill import LLM, SamplingParams

from .variants import QUANT_CLASS, TORCH_CLASS, parse_variant, prompt_ids


def _chosen_quantization(runner) -> tuple[str, int | None] | None:
    """(method, max_rows) of the model's quantized layers, None when it kept its float ones."""
    from quill.model.quant import QuantizedLinear

    model = getattr(runner, "model", None)
    for module in model.modules() if model is not None else ():
        if isinstance(module, QuantizedLinear):
            return module.method, module.max_rows
    return None


def long_slack(batch: int, context: int, budget: int | None) -> int:
    """Tokens the first sequences can decode while the last ones still prefill: the steps of
    chunked prefill (each step's budget shared with the running decodes), plus a margin."""
    budget = budget or 512
    return math.ceil(batch * context / max(budget - batch, 1)) + batch + 8


class QuillColumn:
    kind = "quill"

    def __init__(self, variant: str, kv_cache_memory: int, compile: bool, model: str | None):
        self.options = parse_variant(variant)
        self.llm = LLM(model, kv_cache_memory=kv_cache_memory, compile=compile, **self.options)
        engine = self.llm.engine
        self.dtype = engine.dtype
        quant = self.options.get("quantization")
        chosen = _chosen_quantization(engine.runner)
        if variant == "default":  # paired with its small steps' storage (int8: Q8_0)
            quant = chosen[0] if chosen else None
        self.precision = QUANT_CLASS.get(quant, TORCH_CLASS.get(self.dtype, str(self.dtype)))
        # Every column says what it pins and what quill chose: "quill-auto" pins quantization
        # none, which is not the engine's default (quantization auto), "default" pins nothing.
        dtype = str(self.dtype).removeprefix("torch.")
        picked = f", {chosen[0]} up to {chosen[1]} rows" if chosen and chosen[1] else ""
        if variant == "default":
            self.name = f"quill-default ({dtype}{picked})"
        else:
            pinned = self.options.get("quantization", "none")
            self.name = f"quill-{variant} ({dtype}, quantization={pinned}{picked})"
        self.weight_bytes = _held_bytes(getattr(engine.runner, "model", None))
        caches = getattr(engine.runner, "kv_caches", None)
        self.kv_element_size = (
            caches[0][0].element_size()
            if caches
            else torch.empty(0, dtype=self.dtype).element_size()
        )
        self.kv_bytes_per_token = engine.model_config.kv_bytes_per_token * self.kv_element_size
        self._prefills = 0
        self.llm.generate([prompt_ids(64, 99)], SamplingParams(max_tokens=4), use_tqdm=False)

    def prefill(self, n: int, seed: int) -> dict:
        # A fresh prompt every call, so that no cache of an earlier round could serve it.
        self._prefills += 1
        out = self.llm.generate(
            [prompt_ids(n, seed + 7919 * self._prefills)],
            SamplingParams(max_tokens=1),
            use_tqdm=False,
        )[0]
        return {"seconds": out.metrics.time_to_first_token}

    def decode(self, batch: int, prompt: int, new_tokens: int) -> dict:
        engine = self.llm.engine
        params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
        for i in range(batch):
            engine.add_request(prompt_ids(prompt, 1000 + i), params)
        step_times = []
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            if engine.last_step and engine.last_step.num_prefill_tokens == 0:
                step_times.append(time.perf_counter() - t)
        total = time.perf_counter() - start
        step_ms = 1000 * statistics.median(step_times)
        return {
            "step_ms": step_ms,
            "tokens_per_s": batch * new_tokens / total,
            "decode_tokens_per_s": batch * len(step_times) / sum(step_times),
        }

    def bench_decode(self, new_tokens: int) -> dict:
        """One sequence, a 1-token prompt, decode only: what llama-bench's tg measures."""
        d = self.decode(1, 1, new_tokens)
        return {"step_ms": d["step_ms"], "decode_tokens_per_s": d["decode_tokens_per_s"]}

    def long_decode(self, batch: int, context: int, new_tokens: int) -> dict:
        """Decode steps with all `batch` sequences past their `context`-token prompts.

        Chunked prefill lets early sequences decode while later ones still prefill, so the
        requests ask for enough tokens to outlast the prefill; once a step decodes every
        sequence and prefills nothing, the next `new_tokens` such steps are timed, and the
        requests are aborted.
        """
        engine = self.llm.engine
        slack = long_slack(batch, context, engine.scheduler.token_budget)
        params = SamplingParams(max_tokens=new_tokens + slack, temperature=0, ignore_eos=True)
        ids = [engine.add_request(prompt_ids(context, 2000 + i), params) for i in range(batch)]
        times, contexts = [], []
        try:
            while engine.has_unfinished_requests() and len(times) < new_tokens:
                t = time.perf_counter()
                outputs = engine.step()
                dt = time.perf_counter() - t
                s = engine.last_step
                if s and s.num_prefill_tokens == 0 and s.num_decode_tokens == batch:
                    times.append(dt)
                    # KV read by this step: every token already cached plus the new one.
                    contexts.append(
                        statistics.mean(
                            len(o.prompt_token_ids) + len(o.outputs[0].token_ids) for o in outputs
                        )
                    )
        finally:
            for rid in ids:
                engine.abort_request(rid)
            while engine.has_unfinished_requests():
                engine.step()
        if not times:
            raise RuntimeError(f"quill: no pure decode step at {batch} x {context} tokens")
        step_s = statistics.median(times)
        mean_context = statistics.mean(contexts)
        kv_bytes = batch * mean_context * self.kv_bytes_per_token
        return {
            "step_ms": 1000 * step_s,
            "decode_tokens_per_s": batch * len(times) / sum(times),
            "context": mean_context,
            "kv_bytes_per_step": kv_bytes,
            "kv_read_Bps": kv_bytes / step_s,
            "kv_plus_weights_Bps": (kv_bytes + (self.weight_bytes or 0)) / step_s,
        }


def _held_bytes(model) -> int | None:
    """Bytes of the tensors a model holds: parameters, buffers, and plain tensor attributes
    (where quantized layers keep their codes and scales). With quantization "auto" this counts
    both the float and the int8 copies."""
    if not isinstance(model, torch.nn.Module):
        return None
    seen: dict[tuple, int] = {}
    for module in model.modules():
        found = [*module._parameters.values(), *module._buffers.values(), *vars(module).values()]
        for t in found:
            if isinstance(t, torch.Tensor) and t.numel():
                seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values()) or None
