"""Speculative decoding in the simulator (quill/sim/speculation.py): the engine core's own
drafts, verification and switch, with drafts and verdicts drawn from measured chances.

Checked against hand-worked steps (a lone request whose drafts all hold, or none do: which
passes the scheduler makes, each at its cost-model price), against the chances it was given
(a long run's counters give them back), and against the switch's rule (drafts that never hold
are turned off; drafts that hold pay at a small batch)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from quill.config import SpeculativeConfig
from quill.cost.batch import BatchShape
from quill.cost.model import ModelSpec
from quill.sim.cluster import run_colocated
from quill.sim.config import SimConfig
from quill.sim.speculation import SpecChances, expected_accepted
from quill.sim.workload import LengthSpec, synthetic
from tests.test_sim import TOY


def _config(chances: SpecChances, by_cost: bool = False, k: int = 3, **kwargs) -> SimConfig:
    model = ModelSpec.preset("SmolLM2-135M", 2)
    config = SimConfig.create(model, TOY, max_model_len=4096, **kwargs)
    spec = SpeculativeConfig("ngram", k, 2, 3, by_cost)
    return replace(config, speculative=spec, spec_chances=chances, step_gap=(0.001, 0.0))


def _lone(config: SimConfig) -> dict:
    item = next(iter(synthetic(1, 1.0, LengthSpec(50, 50), LengthSpec(9, 9), seed=0)))
    return run_colocated(config, [item])


def _hand_e2e(config: SimConfig, decodes: list[tuple[int, int]]) -> float:
    """The prompt's pass, then each decode pass (start, tokens: 1 + its drafts; a row of logits
    for each), each with the 1 ms gap after it."""
    price = config.cost.price
    prefill = price(BatchShape.from_seqs([(0, 50, True, False)])).predicted_s + 0.001
    steps = [price(BatchShape.from_seqs([(s, n, n, True)])).predicted_s + 0.001
             for s, n in decodes]  # fmt: skip
    return prefill + sum(steps)


def test_drafts_that_all_hold_give_four_tokens_a_pass():
    """9 tokens: the prompt's pass gives 1; each decode with 3 drafts that hold gives 4."""
    config = _config(SpecChances(proposal_rate=1.0, acceptance=1.0))
    out = _lone(config)
    assert out["replicas"][0]["steps"] == 3
    e2e = _hand_e2e(config, [(50, 4), (54, 4)])
    assert out["results"]["e2e_ms"]["mean"] == pytest.approx(e2e * 1e3, rel=1e-12)
    stats = out["replicas"][0]
    assert stats["spec_decode_num_drafts"] == 2
    assert stats["spec_decode_num_draft_tokens"] == stats["spec_decode_num_accepted_tokens"] == 6
    assert out["results"]["spec_acceptance_rate"] == 1.0


def test_drafts_that_never_hold_cost_their_passes():
    """Each decode verifies 3 drafts (fewer near the end: no draft past max_tokens - 1) and
    keeps one token: 8 decode passes, each priced with its drafts."""
    config = _config(SpecChances(proposal_rate=1.0, acceptance=0.0))
    out = _lone(config)
    decodes = [(50, 4), (51, 4), (52, 4), (53, 4), (54, 4), (55, 3), (56, 2), (57, 1)]
    assert out["replicas"][0]["steps"] == 1 + len(decodes)
    e2e = _hand_e2e(config, decodes)
    assert out["results"]["e2e_ms"]["mean"] == pytest.approx(e2e * 1e3, rel=1e-12)
    assert out["results"]["spec_acceptance_rate"] == 0.0


def test_the_chances_measured_come_back_from_a_long_run():
    """Drafts drawn with given chances: the run's counters, read as a server's are, give the
    same chances back."""
    given = SpecChances(proposal_rate=0.5, mean_length=2.5, acceptance=0.6)
    config = _config(given, k=4)
    items = list(synthetic(40, 5.0, LengthSpec(32, 64), LengthSpec(400, 400), seed=1))
    stats = run_colocated(config, items)["replicas"][0]
    back = SpecChances.measured(*(stats[f"spec_decode_num_{k}"] for k in
                                  ("drafts", "draft_tokens", "accepted_tokens", "eligible",
                                   "proposed")))  # fmt: skip
    assert back.proposal_rate == pytest.approx(0.5, abs=0.02)
    assert back.mean_length == pytest.approx(2.5, abs=0.05)
    assert back.acceptance == pytest.approx(0.6, abs=0.03)


def test_measured_chances_by_hand():
    # Proposals of 2 or 3 drafts, half each: 0.5 * (a + a^2) + 0.5 * (a + a^2 + a^3).
    assert expected_accepted(0.5, 2.5) == pytest.approx(0.8125, rel=1e-15)
    chances = SpecChances.measured(100, 250, 81.25, num_eligible=200, num_proposed=100)
    assert (chances.proposal_rate, chances.mean_length) == (0.5, 2.5)
    assert chances.acceptance == pytest.approx(0.5, abs=1e-12)
    assert SpecChances.measured(0, 0, 0).proposal_rate == 0.0  # nothing verified
    with pytest.raises(ValueError, match="acceptance"):
        SpecChances(acceptance=1.5)


def test_the_switch_turns_off_drafts_that_never_hold_and_keeps_those_that_pay():
    items = list(synthetic(8, 2.0, LengthSpec(64, 64), LengthSpec(200, 200), seed=2))
    off = run_colocated(replace(_config(SpecChances()), speculative=None), items)["results"]
    never = run_colocated(_config(SpecChances(1.0, None, 0.0), by_cost=True), items)
    always = run_colocated(_config(SpecChances(1.0, None, 0.95), by_cost=True), items)
    # Never holding: after its first tries the switch stops them (a probe now and then).
    stats = never["replicas"][0]
    assert stats["spec_decode_num_drafts"] < 0.1 * stats["prefill_tokens"]
    assert never["results"]["e2e_ms"]["mean"] == pytest.approx(off["e2e_ms"]["mean"], rel=0.05)
    # Holding at a batch of a few sequences (the weights' read dominates): on, and faster.
    stats = always["replicas"][0]
    assert stats["spec_decode_num_accepted_tokens"] > 0.5 * 8 * 200
    assert always["results"]["e2e_ms"]["mean"] < 0.6 * off["e2e_ms"]["mean"]


def test_quill_simulate_takes_the_speculative_config_and_the_chances(capsys):
    from tests.test_sim import run_cli

    spec = '{"method": "ngram", "num_speculative_tokens": 3, "by_cost": false}'
    base = ["--num-requests", "20", "--request-rate", "5", "--speculative-config", spec]
    code, out, _ = run_cli([*base, "--spec-acceptance", "1"], capsys)
    assert code == 0 and ", 0 preemptions, " in out
    drafted = int(out.split(" of ")[-1].split(" drafts")[0].replace(",", ""))
    assert f"{drafted:,} of {drafted:,} drafts accepted" in out  # every one held
    code, _, err = run_cli([*base, "--spec-acceptance", "1.5"], capsys)
    assert code == 2 and "acceptance must be within [0, 1], got 1.5" in err
    code, _, err = run_cli(["--speculative-config", '{"method": "eagle"}'], capsys)
    assert code == 2 and "quill proposes by n-gram lookup only" in err
