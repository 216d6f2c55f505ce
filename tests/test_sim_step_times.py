"""What the simulator adds to a step's price for tails: the host's time between steps and the
step-to-step jitter a serving calibration measured (quill/sim/jitter.py), checked against
hand-worked queues and against the measured ratios they come from."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from quill.cost.batch import BatchShape
from quill.cost.model import ModelSpec
from quill.cost.refit import step_gaps, step_time_ratios_by_kind
from quill.cost.step import CostModel
from quill.cost.sweep import MeasuredStep
from quill.sim.cluster import run_colocated
from quill.sim.config import SimConfig
from quill.sim.jitter import StepJitter
from quill.sim.workload import WorkItem
from tests.test_sim import TOY


def _prices(model) -> tuple[list[float], list[float]]:
    """Prompt 100 under a 64-token budget: two chunks, then four decodes (test_sim.py)."""
    cost = CostModel(model, TOY)
    chunks = [BatchShape.from_seqs([(0, 64, False, False)]), BatchShape.abstract([(36, 64)])]
    decodes = [BatchShape.decodes(1, context) for context in (100, 101, 102, 103)]
    return [cost.price(s).predicted_s for s in chunks], [cost.price(s).predicted_s for s in decodes]


def test_a_lone_request_pays_each_step_its_price_times_the_draw_plus_the_gap():
    model = ModelSpec.abstract(1e9, 2)
    plain = SimConfig.create(model, TOY, max_num_batched_tokens=64, max_model_len=1024)
    # Every ratio 1.5: each step takes 1.5x its price, then 2 ms + 0.5 ms per sequence.
    config = replace(plain, step_jitter=(1.5,) * 101, step_gap=(0.002, 0.0005))
    item = WorkItem("0", 0.5, prompt_tokens=100, output_tokens=5)
    out = run_colocated(config, [item])["results"]
    prefill, decode = _prices(model)
    gap = 0.002 + 0.0005
    steps = [1.5 * p + gap for p in prefill], [1.5 * d + gap for d in decode]
    assert out["ttft_ms"]["mean"] == pytest.approx(sum(steps[0]) * 1000, rel=1e-12)
    assert out["e2e_ms"]["mean"] == pytest.approx((sum(steps[0]) + sum(steps[1])) * 1000, rel=1e-12)
    assert out["itl_ms"]["max"] == pytest.approx(max(steps[1]) * 1000, rel=1e-12)


def test_an_arrival_waits_for_the_step_running_when_it_comes():
    """B arrives while A's first chunk runs: it starts only when that step (and its gap)
    ends, and its prompt (10 tokens) rides in the next step beside A's second chunk."""
    model = ModelSpec.abstract(1e9, 2)
    config = replace(
        SimConfig.create(model, TOY, max_num_batched_tokens=64, max_model_len=1024),
        step_gap=(0.001, 0.0),
    )
    cost = CostModel(model, TOY)
    first = cost.price(BatchShape.from_seqs([(0, 64, False, False)])).predicted_s + 0.001
    a = WorkItem("a", 0.0, prompt_tokens=100, output_tokens=2)
    b = WorkItem("b", first / 2, prompt_tokens=10, output_tokens=2)
    out = run_colocated(config, [a, b], record=True)
    # Step 2 holds A's last 36 prompt tokens and B's whole prompt (46 of the 64 tokens).
    second = cost.price(BatchShape.from_seqs([(64, 36, True, False), (0, 10, True, False)]))
    both_done = first + second.predicted_s + 0.001
    ttft = out["results"]["ttft_ms"]
    assert ttft["max"] == pytest.approx(both_done * 1000, rel=1e-12)  # A, from t = 0
    ttft_b = both_done - first / 2
    assert ttft["mean"] == pytest.approx((both_done + ttft_b) / 2 * 1000, rel=1e-12)


def test_each_kind_of_step_draws_from_its_own_ratios():
    """Prefill steps measured at their price (ratio 1), decodes at 2x, mixed not measured apart
    (all steps' 1.5): the lone request's two chunks at 1x, its four decodes at 2x."""
    model = ModelSpec.abstract(1e9, 2)
    plain = SimConfig.create(model, TOY, max_num_batched_tokens=64, max_model_len=1024)
    by_kind = {"prefill": (1.0,) * 101, "decode": (2.0,) * 101}
    config = replace(plain, step_jitter=(1.5,) * 101, step_jitter_by_kind=by_kind)
    item = WorkItem("0", 0.0, prompt_tokens=100, output_tokens=5)
    out = run_colocated(config, [item])["results"]
    prefill, decode = _prices(model)
    # The second chunk samples the first token: a prefill step (no decode in it).
    assert out["ttft_ms"]["mean"] == pytest.approx(sum(prefill) * 1000, rel=1e-12)
    e2e = sum(prefill) + 2 * sum(decode)
    assert out["e2e_ms"]["mean"] == pytest.approx(e2e * 1000, rel=1e-12)


def test_ratios_by_kind_need_enough_steps_of_the_kind():
    decodes = [MeasuredStep(f"d{i}", "decode", 0.01 * (1 + i / 100), [(9, 1, 1, 1)])
               for i in range(100)]  # fmt: skip
    mixed = [MeasuredStep(f"m{i}", "mixed", 0.05, [(9, 1, 1, 1), (0, 9, 1, 0)]) for i in range(5)]
    ratios = step_time_ratios_by_kind(decodes + mixed, [0.01] * 100 + [0.1] * 5)
    assert list(ratios) == ["decode"]  # 5 mixed steps: too few for their own
    assert ratios["decode"][0] == pytest.approx(1.0) and ratios["decode"][100] == pytest.approx(
        1.99
    )
    assert ratios["decode"][50] == pytest.approx(1.495)


def test_draws_follow_the_measured_ratios():
    rng = np.random.default_rng(0)
    measured = rng.lognormal(0.0, 0.3, 5000)
    percentiles = [float(x) for x in np.percentile(measured, range(101))]
    jitter = StepJitter(percentiles, seed="0:replica 0")
    draws = np.array([jitter.draw() for _ in range(20000)])
    for q in (10, 50, 90, 99):
        assert np.percentile(draws, q) == pytest.approx(np.percentile(measured, q), rel=0.03)
    again = StepJitter(percentiles, seed="0:replica 0")
    assert [again.draw() for _ in range(5)] == list(draws[:5])  # a run repeats
    with pytest.raises(ValueError):
        StepJitter([1.0, 0.5] + [1.0] * 99, seed=0)


def test_step_gaps_recover_the_hosts_time_between_busy_steps():
    """Records as `--record-steps` writes them: back-to-back steps 0.3 ms + 20 us per sequence
    apart (with noise), and idle pauses the fit must leave out."""
    rng = np.random.default_rng(1)
    records, t = [], 0.0
    for i in range(400):
        n = int(rng.integers(1, 33))
        duration = 0.005 + 0.0002 * n
        records.append({"step": i, "start": t, "duration": duration, "seqs": [[0, 1, 1, 1]] * n})
        t += duration + 0.0003 + 0.00002 * n + rng.normal(0, 2e-5)
        if i % 50 == 49:
            t += 0.5  # idle: no request waiting
    gaps = step_gaps(records)
    assert gaps["base_s"] == pytest.approx(0.0003, abs=2e-5)
    assert gaps["per_seq_s"] == pytest.approx(0.00002, rel=0.05)
    assert gaps["steps"] == 400 - 1 - 7
    assert step_gaps(records[:5]) is None  # too few to say


def test_the_way_in_and_out_adds_to_ttft_and_e2e_only():
    model = ModelSpec.abstract(1e9, 2)
    plain = SimConfig.create(model, TOY, max_num_batched_tokens=64, max_model_len=1024)
    item = WorkItem("0", 0.5, prompt_tokens=100, output_tokens=5)
    base = run_colocated(plain, [item])["results"]
    out = run_colocated(replace(plain, front_latency_s=0.009), [item])["results"]
    assert out["ttft_ms"]["mean"] == pytest.approx(base["ttft_ms"]["mean"] + 9.0, rel=1e-12)
    assert out["e2e_ms"]["mean"] == pytest.approx(base["e2e_ms"]["mean"] + 9.0, rel=1e-12)
    assert out["itl_ms"] == base["itl_ms"]


def test_a_preemption_and_a_chunk_beside_a_decode_by_hand():
    """Blocks of 4 tokens, a pool of 5, a budget of 8, no prefix cache. A (6 prompt, 6 reply)
    arrives at 0; B (6 prompt, 4 reply) during A's prefill.

    1. A's prompt (6 tokens, 2 blocks).
    2. A's decode at 6 beside B's whole prompt (2 blocks): 4 blocks in use.
    3. both decode (A at 7, B at 6).
    4. A at 8 takes the last free block; B at 7.
    5. B at 8 needs a block and none is free: B, the latest admitted, is preempted (its 2
       blocks freed, its 3 tokens kept); A decodes alone at 9, and nothing is admitted in the
       step that preempted.
    6. A at 10 (its 6th token: it ends) beside B's recompute, 7 of its 9 tokens (the budget
       left), sampling nothing.
    7. B's last 2 tokens (a 2-token chunk: prefill), sampling its 4th token: it ends.
    Every step costs its price plus 1 ms and 0.2 ms a sequence."""
    model = ModelSpec.abstract(1e9, 2)
    config = SimConfig.create(
        model,
        TOY,
        max_num_seqs=4,
        max_num_batched_tokens=8,
        block_size=4,
        max_model_len=1024,
        enable_prefix_caching=False,
    )
    config = replace(config, num_blocks=5, step_gap=(0.001, 0.0002))
    cost = CostModel(model, TOY)
    shapes = [
        [(0, 6, True, False)],
        [(6, 1, True, True), (0, 6, True, False)],
        [(7, 1, True, True), (6, 1, True, True)],
        [(8, 1, True, True), (7, 1, True, True)],
        [(9, 1, True, True)],
        [(10, 1, True, True), (0, 7, False, False)],
        [(7, 2, True, False)],
    ]
    ends, t = [], 0.0
    for seqs in shapes:
        t += cost.price(BatchShape.from_seqs(seqs)).predicted_s + 0.001 + 0.0002 * len(seqs)
        ends.append(t)
    e1, e2, e3, e4, e5, e6, e7 = ends
    b_arrives = e1 / 2
    items = [WorkItem("a", 0.0, prompt_tokens=6, output_tokens=6),
             WorkItem("b", b_arrives, prompt_tokens=6, output_tokens=4)]  # fmt: skip
    out = run_colocated(config, items)
    results = out["results"]
    assert results["num_preemptions"] == 1
    assert out["replicas"][0]["steps"] == 7
    ttft = [e1, e2 - b_arrives]
    e2e = [e6, e7 - b_arrives]
    # A's gaps, then B's: the last one spans its preemption and recompute.
    itl = [e2 - e1, e3 - e2, e4 - e3, e5 - e4, e6 - e5, e3 - e2, e4 - e3, e7 - e4]
    for key, values in (("ttft_ms", ttft), ("e2e_ms", e2e), ("itl_ms", itl)):
        got = results[key]
        assert got["count"] == len(values), key
        assert got["mean"] == pytest.approx(np.mean(values) * 1000, rel=1e-9), key
        assert got["max"] == pytest.approx(max(values) * 1000, rel=1e-9), key
        assert got["p50"] == pytest.approx(np.percentile(values, 50) * 1000, rel=1e-9), key
