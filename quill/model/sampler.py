"""Sampling over the batch of rows that produce a token this step, as tensor operations.

Penalties, temperature, top-k, top-p and min-p are applied to the whole [rows, vocab] block at
once. Drawing uses the exponential race (argmax of p / E with E ~ Exp(1)), which equals sampling
from p; each seeded request draws its noise from its own generator, so its output does not depend
on what else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from quill.engine.plan import SeqPlan


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (chosen token's logprob, [(token id, logprob)] top-n) or None when not asked for
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Holds the random state: one generator for unseeded rows, one per seeded request."""

    def __init__(self, device: torch.device, seed: int = 0) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}

    def free(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def _generator_for(self, request: SeqPlan) -> torch.Generator:
        gen = self.request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)
            self.request_generators[request.request_id] = gen
        return gen

    def __call__(self, logits: torch.Tensor, requests: list[SeqPlan]) -> SampleResult:
        logits = logits.float()
        params = [r.sampling_params for r in requests]
        raw_logits = logits
        if any(p.uses_penalties for p in params):
            logits = apply_penalties(logits, requests)
        if all(p.greedy for p in params):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, requests)
        token_list = tokens.tolist()
        return SampleResult(token_list, compute_logprobs(raw_logits, tokens, params))

    def _sample(self, logits: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
        params = [r.sampling_params for r in requests]
        device = logits.device
        greedy = torch.tensor([p.greedy for p in params], device=device)
        temperature = torch.tensor([p.temperature or 1.0 for p in params], device=device)
        logits = logits / temperature[:, None]
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            logits = _top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
            keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(keep, probs, 0.0)
        noise = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, request in enumerate(requests):
            if request.sampling_params.seed is not None:
                noise[i].exponential_(generator=self._generator_for(request))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(greedy, logits.argmax(dim=-1), sampled)


def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    device = logits.device
    vocab = logits.shape[-1]
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device)
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    rank = torch.arange(vocab, device=device)[None, :]
    drop = rank >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p; the first is always kept.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
    """Repetition (over prompt and output, as in transformers), presence and frequency (output).

    Rows without penalties carry no token history (None), which counts as none.
    """
    device = logits.device
    rows, vocab = logits.shape
    params = [r.sampling_params for r in requests]
    outputs = [r.output_token_ids or [] for r in requests]
    max_out = max((len(o) for o in outputs), default=0)
    out_counts = torch.zeros(rows, vocab + 1, device=device)
    if max_out:
        padded = [o + [vocab] * (max_out - len(o)) for o in outputs]
        ids = torch.tensor(padded, device=device)
        out_counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=out_counts.dtype))
    out_counts = out_counts[:, :vocab]
    rep = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
    if (rep != 1.0).any():
        seen = out_counts > 0
        for i, r in enumerate(requests):
            if params[i].repetition_penalty != 1.0:
                seen[i, torch.tensor(r.prompt_token_ids, device=device)] = True
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalized, logits)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    return logits - frequency * out_counts - presence * (out_counts > 0).float()


def compute_logprobs(logits: torch.Tensor, tokens: torch.Tensor, params) -> list:
    wanted = [p.logprobs for p in params]
    if all(n is None for n in wanted):
        return [None] * len(params)
    logprobs = logits.log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1).tolist()
    k = max(n or 0 for n in wanted)
    top_vals, top_ids = logprobs.topk(k, dim=-1) if k else (None, None)
    result = []
    for i, n in enumerate(wanted):
        if n is None:
            result.append(None)
            continue
        top = list(zip(top_ids[i, :n].tolist(), top_vals[i, :n].tolist())) if n else []
        result.append((chosen[i], top))
    return result
