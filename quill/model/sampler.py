"""Sampling over the batch of rows that produce a token this step, as tensor operations.

Penalties, min_tokens, temperature, top-k, top-p and min-p are applied to the whole
[rows, vocab] block at once. Drawing uses the exponential race (argmax of p / E with
E ~ Exp(1)), which equals sampling from p; each seeded request draws its noise from its own
generator, so its output does not depend on what else shares the batch.

Every parameter a request may legally hold gives a usable distribution: extreme values act as
the limit they approach (a tiny temperature is greedy, a tiny top_p keeps the top token) and
whatever overflows float32 is clamped, so no row ends up NaN or with no token left to pick.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from quill.contract.plan import SampleLogprobs, SeqPlan
from quill.contract.sampling_params import SamplingParams
from quill.model.spec_verify import accept_greedy, verify_drafts
from quill.ops import fused

_F32_MAX = torch.finfo(torch.float32).max
_F32_TINY = torch.finfo(torch.float32).tiny
# A repetition penalty is bounded to these so that it and its reciprocal stay normal float32
# numbers (denormals flush to zero on CPU, and a zero divisor would make inf and NaN).
_REP_MIN, _REP_MAX = 1e-37, 1e37


@dataclass
class SampleResult:
    token_ids: list[int]
    # per row: (chosen token's logprob, [(token id, logprob)] top-n) or None when not asked for
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    """Holds the random state: one generator for unseeded rows, one per seeded request."""

    def __init__(
        self, device: torch.device, seed: int = 0, end_token_ids: Sequence[int] = ()
    ) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        # The model's end-of-sequence ids, kept from being sampled before min_tokens.
        self.end_token_ids = list(end_token_ids)

    def free(self, request_id: str) -> None:
        self.request_generators.pop(request_id, None)

    def __call__(self, logits: torch.Tensor, requests: list[SeqPlan]) -> SampleResult:
        if any(r.draft_token_ids for r in requests):
            raise ValueError("rows with draft tokens are verified by Sampler.verify")
        params = [r.sampling_params for r in requests]
        raw_logits = logits.float()
        logits = prepare_logits(raw_logits, requests, self.end_token_ids)
        if all(p.greedy for p in params):
            tokens = fused.argmax(logits)
        else:
            tokens = self._draw(processed_probs(logits, params), requests)
        token_list = tokens.tolist()
        return SampleResult(token_list, compute_logprobs(raw_logits, tokens, params))

    def probs(self, logits: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
        """The distribution each row is drawn from, exactly as `__call__` computes it."""
        prepared = prepare_logits(logits.float(), requests, self.end_token_ids)
        return processed_probs(prepared, [r.sampling_params for r in requests])

    def verify(
        self, logits: torch.Tensor, requests: list[SeqPlan]
    ) -> tuple[list[list[int]], list[list[SampleLogprobs] | None]]:
        """Per request its tokens: the drafts the model accepts (quill/model/spec_verify.py)
        and one more, or one token for a request without drafts; and their logprobs where
        asked. `logits` holds each request's `num_sample_rows` rows in order. The scheduler gives
        drafts only where every drafted position is processed alike (no penalties, token
        masks or min_tokens yet to reach), so each row is prepared as its request's."""
        counts = [r.num_sample_rows for r in requests]
        expanded = [r for r, c in zip(requests, counts) for _ in range(c)]
        raw = logits.float()
        prepared = prepare_logits(raw, expanded, self.end_token_ids)
        device, k = logits.device, max(counts) - 1
        first = torch.tensor(counts, device=device).cumsum(0) - torch.tensor(counts, device=device)
        num_drafts = torch.tensor([c - 1 for c in counts], device=device)
        # Each request's rows for positions 0 .. k, its last one repeated past its own drafts.
        at = torch.arange(k + 1, device=device)
        index = first[:, None] + torch.minimum(at[None, :], num_drafts[:, None])
        drafts = torch.tensor(
            [(r.draft_token_ids or []) + [0] * (k - r.num_drafts) for r in requests],
            dtype=torch.long,
            device=device,
        )
        params = [r.sampling_params for r in requests]
        if all(p.greedy for p in params):
            accepted, after = accept_greedy(fused.argmax(prepared)[index], drafts, num_drafts)
        else:
            probs = processed_probs(prepared, [r.sampling_params for r in expanded])[index]
            greedy = torch.tensor([p.greedy for p in params], device=device)
            uniform, noise = self._random(requests, probs.shape[-1], k)
            accepted, after = verify_drafts(probs, drafts, num_drafts, greedy, uniform, noise)
        num_accepted, next_ids = accepted.tolist(), after.tolist()
        tokens = [
            (r.draft_token_ids or [])[:n] + [t] for r, n, t in zip(requests, num_accepted, next_ids)
        ]
        if all(p.logprobs is None for p in params):
            return tokens, [None] * len(requests)
        rows = [c0 + j for c0, ts in zip(first.tolist(), tokens) for j in range(len(ts))]
        flat = torch.tensor([t for ts in tokens for t in ts], device=device)
        row_params = [p for p, ts in zip(params, tokens) for _ in ts]
        flat_logprobs = compute_logprobs(raw[rows], flat, row_params)
        logprobs, i = [], 0
        for p, ts in zip(params, tokens):
            logprobs.append(None if p.logprobs is None else flat_logprobs[i : i + len(ts)])
            i += len(ts)
        return tokens, logprobs

    def _draw(self, probs: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
        _, noise = self._random(requests, probs.shape[-1], 0)
        return fused.argmax(probs / noise)

    def _random(
        self, requests: list[SeqPlan], vocab: int, k: int
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Per row `k` uniforms in [0, 1) (for accepting drafts) and Exp(1) noise over the
        vocabulary (for drawing a token as argmax p / E), from its request's generator when
        seeded, else the sampler's."""
        seeded = [i for i, r in enumerate(requests) if r.sampling_params.seed is not None]
        # A failed step is retried one request at a time: a seeded request must then draw the
        # same noise again, so its generator goes back to where it was if anything here raises.
        gens = self.request_generators
        ids = [requests[i].request_id for i in seeded]
        saved = {rid: gens[rid].get_state() for rid in ids if rid in gens}
        device = self.device
        try:
            shape = (len(requests), vocab)
            noise = torch.empty(shape, device=device).exponential_(generator=self.generator)
            uniform = None
            if k:
                uniform = torch.rand(len(requests), k, device=device, generator=self.generator)
            for i in seeded:
                gen = self._generator_for(requests[i], noise[i])
                noise[i].exponential_(generator=gen)
                if k:
                    uniform[i] = torch.rand(k, device=device, generator=gen)
            # Exp(1) can come out as exactly 0; p / 0 would be inf for every kept token and NaN
            # for the dropped ones, which argmax then prefers.
            noise.clamp_(min=_F32_TINY)
            return uniform, noise
        except BaseException:
            for rid in ids:
                if rid in saved:
                    gens[rid].set_state(saved[rid])
                else:
                    gens.pop(rid, None)
            raise

    def _generator_for(self, request: SeqPlan, row: torch.Tensor) -> torch.Generator:
        """The request's generator; a new one is first moved past the draws of the tokens the
        request already has (sampled elsewhere: a prefill instance drew the first), so that a
        reply split over two instances draws what one instance would have."""
        gen = self.request_generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(request.sampling_params.seed)
            drawn = (
                request.start + 1 - request.num_prompt_tokens
                if request.draft_token_ids
                else (request.start + request.num_tokens - request.num_prompt_tokens)
            )
            for _ in range(drawn):
                torch.empty_like(row).exponential_(generator=gen)
            self.request_generators[request.request_id] = gen
        return gen


def prepare_logits(
    logits: torch.Tensor, requests: list[SeqPlan], end_token_ids: Sequence[int] = ()
) -> torch.Tensor:
    """float32 logits after penalties and min_tokens: finite, or -inf where a token is barred.

    A greedy row picks the argmax of these; the others go on to `processed_probs`.
    """
    # NaN would win every argmax; +inf would turn softmax into NaN.
    logits = torch.nan_to_num(logits.float(), nan=float("-inf"), posinf=_F32_MAX)
    if any(r.sampling_params.uses_penalties for r in requests):
        logits = apply_penalties(logits, requests)
    if any(r.sampling_params.logit_bias for r in requests):
        logits = apply_logit_bias(logits, requests)
    if any(r.token_bitmask is not None for r in requests):
        logits = apply_token_masks(logits, requests)
    return suppress_ends(logits, requests, end_token_ids)


def apply_logit_bias(logits: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
    """Adds each row's `logit_bias` to its tokens' logits (one index_put for the step)."""
    rows, cols, values = [], [], []
    for i, r in enumerate(requests):
        for token_id, bias in (r.sampling_params.logit_bias or {}).items():
            rows.append(i)
            cols.append(token_id)
            values.append(bias)
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    bias = torch.tensor(values, dtype=logits.dtype, device=logits.device)
    logits.index_put_(index, bias, accumulate=True)
    return logits


def apply_token_masks(logits: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
    """Bars every token outside a row's `token_bitmask` (bit t of byte t // 8, least
    significant first; tokens past the mask's end are barred). Writes into `logits`."""
    vocab = logits.shape[-1]
    rows = [i for i, r in enumerate(requests) if r.token_bitmask is not None]
    allowed = torch.zeros(len(rows), vocab, dtype=torch.bool)
    for k, i in enumerate(rows):
        bits = torch.frombuffer(bytearray(requests[i].token_bitmask), dtype=torch.uint8)
        # Unpack each byte into its 8 bits, least significant first.
        unpacked = (bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1
        flat = unpacked.flatten()[:vocab].bool()
        if not flat.any():
            raise ValueError(f"request {requests[i].request_id}'s token mask allows no token")
        allowed[k, : flat.numel()] = flat
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    barred = ~allowed.to(logits.device)
    logits[index] = logits[index].masked_fill(barred, float("-inf"))
    return logits


def suppress_ends(
    logits: torch.Tensor, requests: list[SeqPlan], end_token_ids: Sequence[int] = ()
) -> torch.Tensor:
    """Bars end ids (unless ignore_eos) and stop ids from rows short of their min_tokens.

    Writes into `logits`. A sampling row has produced `start + len(token_ids) -
    num_prompt_tokens` tokens: the step reaches its last token, and a preempted request
    recomputes prompt and output alike, so this holds then too.
    """
    vocab = logits.shape[-1]
    rows: list[int] = []
    cols: list[int] = []
    for i, r in enumerate(requests):
        p = r.sampling_params
        if not p.min_tokens or r.start + len(r.token_ids) - r.num_prompt_tokens >= p.min_tokens:
            continue
        if r.token_bitmask is not None:  # a grammar decides when its reply may end
            continue
        barred = set(p.stop_token_ids)
        if not p.ignore_eos:
            barred.update(end_token_ids)
        # An id outside the vocabulary can never be sampled, so it needs no bar.
        barred = [t for t in barred if 0 <= t < vocab]
        rows += [i] * len(barred)
        cols += barred
    if rows:
        index = torch.tensor([rows, cols], device=logits.device)
        logits[index[0], index[1]] = float("-inf")
    return logits


def processed_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row's sampling distribution from `prepare_logits` output: temperature, top-k, top-p
    and min-p applied, normalised; a greedy row is one-hot on its argmax.

    Never NaN and never all zero: the top token is always kept, and a row left with nothing
    (every token barred) falls back to one-hot on its argmax.
    """
    device = logits.device
    top = logits.argmax(dim=-1, keepdim=True)
    one_hot = torch.zeros_like(logits).scatter_(-1, top, 1.0)
    greedy = torch.tensor([p.greedy for p in params], device=device)[:, None]
    # Greedy rows divide by 1 (their result is replaced). A temperature beyond float32's range
    # acts as its largest value: all but astronomically spread logits are uniform by then.
    half_temperature = torch.tensor(
        [0.5 if p.greedy else 0.5 * min(p.temperature, _F32_MAX) for p in params], device=device
    )
    # (x - max) / T, computed as (x/2 - max/2) / (T/2): the same numbers, but a spread of up to
    # twice float32's range cannot overflow. Shifting by the max first means the division can
    # only overflow towards -inf (a weight of 0, as it should be), and leaves the top token at
    # 0: weight 1 at any temperature.
    half = logits * 0.5
    z = (half - half.max(dim=-1, keepdim=True).values) / half_temperature[:, None]
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        # Ranked by the logits: a huge temperature squeezes z into float32 ties.
        z = _top_k_top_p(z, params, rank_by=logits)
    probs = z.softmax(dim=-1)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)
        # min_p <= 1, so the top token always passes.
        keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
    total = probs.sum(dim=-1, keepdim=True)
    usable = total > 0  # false for NaN too
    probs = torch.where(usable & ~greedy, probs / total.clamp(min=_F32_TINY), one_hot)
    return probs


def _top_k_top_p(
    logits: torch.Tensor, params: Sequence[SamplingParams], rank_by: torch.Tensor | None = None
) -> torch.Tensor:
    """`logits` with -inf for what top-k and top-p drop; tokens ranked by `rank_by`, which
    must order them as `logits` does (ties aside), or by `logits` themselves."""
    device = logits.device
    vocab = logits.shape[-1]
    # Clamped here, in Python: top_k may be any size (2**64 overflows an int64 tensor).
    top_k = torch.tensor(
        [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], device=device
    )
    # top_p >= 1 keeps everything; cumulative sums that round past 1 must not say otherwise.
    top_p = torch.tensor([p.top_p if p.top_p < 1.0 else 2.0 for p in params], device=device)
    if rank_by is None:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
    else:
        order = rank_by.argsort(dim=-1, descending=True)
        sorted_logits = logits.gather(-1, order)
    rank = torch.arange(vocab, device=device)[None, :]
    drop = rank >= top_k[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Drop a token when the tokens before it already reach top_p.
    drop |= (probs.cumsum(dim=-1) - probs) >= top_p[:, None]
    # The top token is always kept, whatever a tiny top_p rounds to in float32 (1e-300 is 0).
    drop[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_penalties(logits: torch.Tensor, requests: list[SeqPlan]) -> torch.Tensor:
    """Repetition (over prompt and output, as in transformers), presence and frequency (output).

    Rows without penalties carry no token history (None), which counts as none. The result is
    finite wherever `logits` is (-inf stays -inf): a penalty that would overflow float32 is
    clamped to its largest value.
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
    reps = [min(max(p.repetition_penalty, _REP_MIN), _REP_MAX) for p in params]
    if any(rep != 1.0 for rep in reps):
        rep = torch.tensor(reps, device=device)[:, None]
        seen = out_counts > 0
        prompt_rows: list[int] = []
        prompt_ids: list[int] = []
        for i, r in enumerate(requests):
            if reps[i] != 1.0:
                prompt_rows += [i] * len(r.prompt_token_ids)
                prompt_ids += r.prompt_token_ids
        if prompt_rows:
            index = torch.tensor([prompt_rows, prompt_ids], device=device)
            seen[index[0], index[1]] = True
        penalized = torch.where(logits > 0, logits / rep, logits * rep).clamp(-_F32_MAX, _F32_MAX)
        # Barred tokens (-inf) stay barred.
        logits = torch.where(seen & (logits > float("-inf")), penalized, logits)
    presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
    frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
    # Both are in [-2, 2] and counts are at most the context: far too little to overflow.
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
