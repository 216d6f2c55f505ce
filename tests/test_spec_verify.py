"""Draft verification (quill/model/spec_verify.py): greedy rows keep exactly the argmax run;
sampled rows come out distributed as the target, checked by chi-square over many rows."""

from __future__ import annotations

import torch

from quill.model.spec_verify import verify_drafts

CHI2_DF4_P1E4 = 23.51  # chi-square critical value, 4 degrees of freedom, p = 1e-4


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


def test_greedy_keeps_the_argmax_run_and_adds_the_next_argmax():
    torch.manual_seed(0)
    rows, k, vocab = 6, 4, 11
    probs = torch.randn(rows, k + 1, vocab).softmax(-1)
    best = probs.argmax(-1)  # [rows, k + 1]
    drafts = best[:, :k].clone()
    wrong_at = [0, 1, 2, 3, 4, 4]  # 4: no wrong draft
    for r, j in enumerate(wrong_at):
        if j < k:
            drafts[r, j] = (drafts[r, j] + 1) % vocab
    num_drafts = torch.tensor([4, 4, 4, 4, 4, 2])  # the last row drafted two
    n, nxt = verify_drafts(probs, drafts, num_drafts, torch.ones(rows, dtype=torch.bool),
                           torch.rand(rows, k), torch.ones(rows, vocab))  # fmt: skip
    assert n.tolist() == [0, 1, 2, 3, 4, 2]
    assert nxt.tolist() == [best[r, j].item() for r, j in enumerate(n.tolist())]
    none, first = verify_drafts(probs, drafts[:, :0], torch.zeros(rows, dtype=torch.long),
                                torch.ones(rows, dtype=torch.bool), torch.rand(rows, 0),
                                torch.ones(rows, vocab))  # fmt: skip
    assert none.tolist() == [0] * rows and first.tolist() == best[:, 0].tolist()


def test_sampled_output_is_distributed_as_the_target():
    g = torch.Generator().manual_seed(1)
    rows, vocab = 60_000, 5
    p = torch.tensor(
        [
            [0.1, 0.4, 0.2, 0.2, 0.1],  # after the prompt
            [0.3, 0.1, 0.1, 0.4, 0.1],  # after draft 0
            [0.25, 0.25, 0.1, 0.3, 0.1],
        ]
    )  # after drafts 0 and 1: the bonus
    drafts = torch.tensor([1, 3]).expand(rows, 2)  # likely guesses, so all three paths occur
    probs = p.expand(rows, 3, vocab)
    uniform = torch.rand(rows, 2, generator=g)
    noise = torch.empty(rows, vocab).exponential_(generator=g)
    sampled = torch.zeros(rows, dtype=torch.bool)
    n, nxt = verify_drafts(probs, drafts, torch.full((rows,), 2), sampled, uniform, noise)
    # The first token out: draft 0 when accepted, else the corrected one; distributed as p[0].
    first = torch.where(n >= 1, drafts[:, 0], nxt)
    assert _chi2(torch.bincount(first, minlength=vocab).float(), p[0]) < CHI2_DF4_P1E4
    # Given the first was draft 0, the second is distributed as p[1]; given both drafts, the
    # bonus as p[2].
    second = torch.where(n >= 2, drafts[:, 1], nxt)[n >= 1]
    assert _chi2(torch.bincount(second, minlength=vocab).float(), p[1]) < CHI2_DF4_P1E4
    bonus = nxt[n == 2]
    assert _chi2(torch.bincount(bonus, minlength=vocab).float(), p[2]) < CHI2_DF4_P1E4
    # And acceptance happens at the rates rejection sampling gives: p0(d0), then p1(d1).
    assert abs((n >= 1).float().mean().item() - 0.4) < 0.01
    assert abs((n == 2).float().mean().item() - 0.4 * 0.4) < 0.01


def test_a_rejected_draft_is_never_the_corrected_token():
    g = torch.Generator().manual_seed(2)
    rows, vocab = 5000, 3
    probs = torch.tensor([[0.5, 0.3, 0.2], [0.2, 0.2, 0.6]]).expand(rows, 2, vocab)
    drafts = torch.zeros(rows, 1, dtype=torch.long)
    n, nxt = verify_drafts(probs, drafts, torch.ones(rows, dtype=torch.long),
                           torch.zeros(rows, dtype=torch.bool), torch.rand(rows, 1, generator=g),
                           torch.empty(rows, vocab).exponential_(generator=g))  # fmt: skip
    assert (nxt[n == 0] != 0).all() and (n == 0).any()
