"""The sampling step's per-row inputs: a token mask bars every token outside it (what
structured output will set), and draft tokens are refused until they can be verified. On
--device (a GPU's sampler too)."""

from __future__ import annotations

import pytest
import torch

from quill.contract.plan import SeqPlan
from quill.contract.sampling_params import SamplingParams
from quill.model.sampler import Sampler

VOCAB = 300


def bitmask(allowed: set[int], vocab: int = VOCAB) -> bytes:
    """The mask by hand: bit t of byte t // 8, least significant bit first."""
    out = bytearray((vocab + 7) // 8)
    for t in allowed:
        out[t // 8] |= 1 << (t % 8)
    return bytes(out)


def row(request_id: str, params: SamplingParams, mask: bytes | None = None, drafts=None):
    return SeqPlan(request_id, [5], 3, 3, [[0]], True, params, token_bitmask=mask,
                   draft_token_ids=drafts)  # fmt: skip


@pytest.mark.device
def test_a_greedy_row_picks_the_best_allowed_token_and_others_are_untouched(device):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0)).to(device)
    allowed = {7, 130, 299}
    greedy = SamplingParams(temperature=0)
    rows = [row("masked", greedy, bitmask(allowed)), row("free", greedy), row("one", greedy,
            bitmask({42}))]  # fmt: skip
    got = Sampler(device).__call__(logits, rows).token_ids
    best_allowed = max(allowed, key=lambda t: logits[0, t].item())
    assert got == [best_allowed, int(logits[1].argmax()), 42]


@pytest.mark.device
def test_sampled_tokens_never_leave_the_mask(device):
    logits = torch.zeros(64, VOCAB, device=device)  # uniform: every token as likely as any other
    allowed = {3, 64, 65, 200}
    params = SamplingParams(temperature=1.0, top_p=0.9)
    rows = [row(f"r{i}", params, bitmask(allowed)) for i in range(64)]
    sampler = Sampler(device, seed=1)
    drawn = set()
    for _ in range(5):
        drawn.update(sampler(logits, rows).token_ids)
    assert drawn <= allowed and len(drawn) > 1  # within the mask, and not one token only


@pytest.mark.device
def test_a_short_mask_bars_the_tokens_past_its_end(device):
    logits = torch.zeros(1, VOCAB, device=device)
    logits[0, 250] = 10.0  # the favourite, beyond the mask's 16 bits
    got = Sampler(device)(logits, [row("a", SamplingParams(temperature=0),
                                                    bitmask({9}, 16))])  # fmt: skip
    assert got.token_ids == [9]


@pytest.mark.device
def test_a_mask_that_allows_nothing_and_draft_tokens_are_refused_clearly(device):
    logits = torch.zeros(1, VOCAB, device=device)
    with pytest.raises(ValueError, match="allows no token"):
        Sampler(device)(logits, [row("a", SamplingParams(), bitmask(set()))])
    # Rows with drafts have one row of logits per drafted position: `verify` takes them.
    with pytest.raises(ValueError, match="Sampler.verify"):
        Sampler(device)(logits, [row("a", SamplingParams(), drafts=[1, 2])])
