"""Slow steps come in patches: the memory of the step-time strays, fitted on recorded steps
(quill/cost/refit.py `step_time_memory`) and drawn with by the simulator (quill/sim/jitter.py),
checked against sequences made with known memory and against the ratios it draws from."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from statistics import NormalDist

import numpy as np
import pytest

from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.refit import step_time_memory
from quill.cost.sweep import MeasuredStep
from quill.sim.cli import main
from quill.sim.cluster import run_colocated
from quill.sim.config import SimConfig
from quill.sim.jitter import StepJitter, StepJitters
from quill.sim.workload import WorkItem
from tests.test_sim import TOY

UNIFORM = tuple(1.0 + i / 100 for i in range(101))  # ratios 1..2: a draw's quantile is ratio - 1


def _recorded(shared: float, seconds: float, n: int = 3000, every: float = 0.05, seed: int = 0):
    """Steps `every` seconds apart whose strays share a level wandering with time constant
    `seconds` (`shared` of each score's variance; 0: independent): decodes at ~1x their
    price, one step in ten a mixed step at ~1.3x, prices from 10 to 50 ms."""
    rng = random.Random(seed)
    keep = math.exp(-every / seconds) if seconds else 0.0
    level = rng.gauss(0, 1)
    steps, predicted = [], []
    for i in range(n):
        level = keep * level + math.sqrt(1 - keep * keep) * rng.gauss(0, 1)
        score = math.sqrt(shared) * level + math.sqrt(1 - shared) * rng.gauss(0, 1)
        mixed = i % 10 == 0
        ratio = 1.3 * math.exp(0.1 * score) if mixed else math.exp(0.2 * score)
        price = rng.uniform(0.01, 0.05)
        seqs = [(9, 1, True, True)] + ([(0, 9, True, False)] if mixed else [])
        kind = "mixed" if mixed else "decode"
        steps.append(MeasuredStep(f"s{i}", kind, ratio * price, seqs, start=i * every))
        predicted.append(price)
    return steps, predicted


def test_the_memory_of_recorded_steps_is_fitted_in_time():
    steps, predicted = _recorded(shared=0.6, seconds=1.0)
    memory = step_time_memory(steps, predicted)
    assert memory["shared"] == pytest.approx(0.6, abs=0.12)
    assert 0.6 < memory["seconds"] < 1.7
    assert memory["steps"] == len(steps)
    # Twice as long a memory is found twice as long.
    longer = step_time_memory(*_recorded(shared=0.6, seconds=2.0, n=6000))
    assert 1.4 < longer["seconds"] / memory["seconds"] < 2.8


def test_no_memory_in_independent_steps_or_without_their_times():
    steps, predicted = _recorded(shared=0.0, seconds=0.0)
    memory = step_time_memory(steps, predicted)
    assert memory is None or memory["shared"] < 0.1
    timed, predicted = _recorded(shared=0.6, seconds=1.0)
    untimed = [replace(s, start=None) for s in timed]
    assert step_time_memory(untimed, predicted) is None
    assert step_time_memory(timed[:50], predicted[:50]) is None  # too few to tell


def test_draws_with_memory_keep_the_ratios_and_remember_for_the_measured_time():
    """Quantiles uniform over [0, 1) as without memory; the normal scores of draws 0.05 s apart
    correlate shared * exp(-0.05 / seconds), 2 s apart shared * exp(-2 / seconds)."""
    jitters = StepJitters(None, {"decode": UNIFORM}, seed="0:replica 0", memory=(0.6, 1.0))
    quantiles = np.array([jitters.draw("decode", 0.05 * i) - 1.0 for i in range(40000)])
    assert np.all((quantiles >= 0) & (quantiles <= 1))
    for q in (0.1, 0.5, 0.9):
        assert np.mean(quantiles < q) == pytest.approx(q, abs=0.04)
    scores = np.array([NormalDist().inv_cdf(min(max(u, 1e-9), 1 - 1e-9)) for u in quantiles])
    for lag, want in ((1, 0.6 * math.exp(-0.05)), (40, 0.6 * math.exp(-2.0))):
        got = np.corrcoef(scores[:-lag], scores[lag:])[0, 1]
        assert got == pytest.approx(want, abs=0.05), lag
    # Ten time constants of idling forget the level: pairs across such gaps are independent.
    idle = StepJitters(None, {"decode": UNIFORM}, seed=1, memory=(0.6, 1.0))
    pairs = np.array([[idle.draw("decode", 20.0 * i), idle.draw("decode", 20.0 * i + 0.01)]
                      for i in range(4000)])  # fmt: skip
    assert abs(np.corrcoef(pairs[:-1, 1], pairs[1:, 0])[0, 1]) < 0.05  # across the gaps
    assert np.corrcoef(pairs[:, 0], pairs[:, 1])[0, 1] > 0.45  # 10 ms apart: remembered


def test_independent_draws_are_each_kinds_own_stream_as_before():
    overall = tuple(0.5 + i / 200 for i in range(101))
    jitters = StepJitters(overall, {"decode": UNIFORM}, seed=3)
    decode, other = StepJitter(list(UNIFORM), "3:decode"), StepJitter(list(overall), 3)
    for t in range(20):
        assert jitters.draw("decode", t) == decode.draw()
        assert jitters.draw("prefill", t) == other.draw()  # not measured apart: all steps'
    assert StepJitters(None, {"decode": UNIFORM}, seed=3).draw("mixed", 0.0) == 1.0
    with pytest.raises(ValueError):
        StepJitters(None, {"decode": UNIFORM}, seed=3, memory=(1.5, 1.0))


def test_a_slow_patch_stretches_whole_replies():
    """One request at a time, 40 decodes each: with independent draws each reply's steps
    average out (its time varies ~1/sqrt(40) as much as a step's); with a level that lasts
    longer than a reply, whole replies run slow or fast together."""
    model = ModelSpec.abstract(1e9, 2)
    plain = SimConfig.create(model, TOY, max_model_len=1024)
    jittered = replace(plain, step_jitter=UNIFORM, seed=5)
    items = [WorkItem(str(i), 10.0 * i, prompt_tokens=16, output_tokens=41) for i in range(300)]

    def spread(config) -> float:  # of the replies' end-to-end times: (p90 - p50) / p50
        e2e = run_colocated(config, items)["results"]["e2e_ms"]
        return (e2e["p90"] - e2e["p50"]) / e2e["p50"]

    independent = spread(jittered)
    remembered = spread(replace(jittered, step_memory=(0.8, 30.0)))
    assert remembered > 3 * independent


def test_quill_simulate_draws_with_the_files_memory_unless_told_not_to(tmp_path, capsys):
    spec = HardwareSpec.preset("H100-SXM").to_dict()
    spec["calibration"] = {
        **dict(overhead_s=1e-3, per_seq_s=1e-5, s_per_weight_byte=1 / 3e12),
        **dict(s_per_linear_flop=2e-15, s_per_attention_flop=2e-15, s_per_kv_byte=1 / 3e12),
        "step_time_ratios": list(UNIFORM),
        "step_time_memory": {"shared": 0.8, "seconds": 5.0, "steps": 900},
        "step_time_ratios_by_kind": {"decode": [2 * r for r in UNIFORM]},
    }
    path = tmp_path / "served.json"
    path.write_text(json.dumps(spec))
    args = ["--hardware", str(path), "--num-requests", "200", "--request-rate", "20", "--json",
            "--no-progress"]  # fmt: skip
    reports = {}
    for flag in ("--step-memory", "--no-step-memory"):
        assert main([*args, flag]) == 0
        reports[flag] = json.loads(capsys.readouterr().out)
    assert reports["--step-memory"]["settings"]["scheduler"]["step_memory"] == [0.8, 5.0]
    assert reports["--no-step-memory"]["settings"]["scheduler"]["step_memory"] is None
    with_memory, without = (reports[f]["results"]["e2e_ms"] for f in reports)
    assert with_memory["p90"] - with_memory["p50"] > 2 * (without["p90"] - without["p50"])
    # All steps' ratios unless each kind's are asked for: the decodes' own are twice as slow.
    assert reports["--step-memory"]["settings"]["scheduler"]["step_jitter_kinds"] == []
    assert main([*args, "--step-jitter-by-kind"]) == 0
    by_kind = json.loads(capsys.readouterr().out)
    assert by_kind["settings"]["scheduler"]["step_jitter_kinds"] == ["decode"]
    all_steps = reports["--step-memory"]["results"]["itl_ms"]["p50"]
    assert by_kind["results"]["itl_ms"]["p50"] > 1.5 * all_steps
