"""`quill cost calibrate`: the NNLS fit, the sweep's step shapes, and the file it writes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from quill.cost import fit
from quill.cost.batch import BatchShape
from quill.cost.hardware import CALIBRATION_KEYS, HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel
from tests.conftest import write_tiny_config

# -- NNLS -----------------------------------------------------------------------------------------


def test_nnls_recovers_exact_coefficients_and_keeps_a_zero_one_zero():
    rng = np.random.default_rng(0)
    a = rng.uniform(0.5, 2.0, size=(40, 4))
    truth = np.array([2.0, 0.5, 0.0, 3.0])
    x = fit.nnls(a, a @ truth)
    np.testing.assert_allclose(x, truth, rtol=1e-9, atol=1e-12)
    assert x[2] == 0.0
    assert (x >= 0).all()


def test_nnls_clamps_what_least_squares_would_make_negative():
    rng = np.random.default_rng(1)
    a = rng.uniform(0.0, 1.0, size=(30, 3))
    b = 2.0 * a[:, 0] - 1.0 * a[:, 1] + 0.5 * a[:, 2]
    free = np.linalg.lstsq(a, b, rcond=None)[0]
    assert free[1] < 0  # the unconstrained answer is not admissible
    x = fit.nnls(a, b)
    assert x[1] == 0.0 and (x >= 0).all()
    # Optimality (KKT): no zero coefficient could lower the residual by growing.
    gradient = a.T @ (b - a @ x)
    assert (gradient[x == 0] <= 1e-9).all()
    np.testing.assert_allclose(x[x > 0], np.linalg.lstsq(a[:, x > 0], b, rcond=None)[0])


def test_nnls_meets_the_optimality_conditions_on_random_problems():
    rng = np.random.default_rng(3)
    for _ in range(50):
        a, b = rng.normal(size=(20, 6)), rng.normal(size=20)
        x = fit.nnls(a, b)
        gradient = a.T @ (b - a @ x)
        assert (x >= 0).all()
        assert (gradient[x == 0] <= 1e-8).all()  # no zero coefficient wants to grow
        np.testing.assert_allclose(gradient[x > 0], 0, atol=1e-8)  # the others are optimal


def test_nnls_handles_columns_twelve_orders_apart():
    # Like step features: a constant, a count, and FLOPs in the 1e9-1e12 range.
    rng = np.random.default_rng(2)
    a = np.column_stack(
        [np.ones(25), rng.integers(1, 64, 25), rng.uniform(1e9, 1e12, 25), np.zeros(25)]
    )
    truth = np.array([0.04, 2e-4, 1e-11, 0.0])
    x = fit.nnls(a, a @ truth)
    np.testing.assert_allclose(x, truth, rtol=1e-8)
    assert x[3] == 0.0  # an all-zero column gets no coefficient


# -- fitting step times --------------------------------------------------------------------------


def _cost_model() -> CostModel:
    model = ModelSpec.preset("SmolLM2-135M", bytes_per_param=4)
    model.dtype = "float32"
    spec = HardwareSpec("test", {"float32": 1e11}, memory_bandwidth=1e10, memory_capacity=1e10)
    return CostModel(model, spec)


def _shapes() -> list[BatchShape]:
    shapes = [BatchShape.decodes(b, c) for b in (1, 4, 16, 64) for c in (32, 500, 1500)]
    shapes += [BatchShape.prefills(1, n) for n in (16, 128, 512, 1024)]
    shapes += [BatchShape.from_seqs([(1024, 512, True, False)])]
    shapes += [BatchShape.from_seqs([(500, 1, True, True)] * 8 + [(0, 128, True, False)])]
    return shapes


def test_fit_calibration_recovers_known_step_coefficients():
    cm = _cost_model()
    truth = {
        "overhead_s": 0.020,
        "per_seq_s": 3e-4,
        "s_per_weight_byte": 1 / 20e9,
        "s_per_linear_flop": 1 / 80e9,
        "s_per_attention_flop": 0.0,  # forced to zero: must come back zero
        "s_per_kv_byte": 1 / 2e9,
    }
    shapes = _shapes()
    costs = [cm.price(s) for s in shapes]
    durations = [fit.predict(truth, c, s) for c, s in zip(costs, shapes)]
    got = fit.fit_calibration(costs, shapes, durations, cm.weight_bytes, 1 / 20e9)
    assert list(got) == list(CALIBRATION_KEYS)
    for key, value in truth.items():
        assert got[key] == pytest.approx(value, rel=1e-6, abs=1e-15), key
    assert got["s_per_attention_flop"] == 0.0


def test_fit_splits_the_intercept_at_the_measured_streaming_rate():
    cm = _cost_model()
    shapes = _shapes()
    costs = [cm.price(s) for s in shapes]
    intercept = 0.005 + cm.weight_bytes / 50e9  # 5 ms of overhead, weights at 50 GB/s
    durations = [intercept + c.linear_flops / 1e11 for c in costs]
    # The microbenchmark streamed 100 GB/s: the weights take that long, the rest is overhead.
    got = fit.fit_calibration(costs, shapes, durations, cm.weight_bytes, 1 / 100e9)
    assert got["s_per_weight_byte"] == pytest.approx(1 / 100e9)
    assert got["overhead_s"] == pytest.approx(intercept - cm.weight_bytes / 100e9, rel=1e-6)
    # It reached only 10 GB/s, slower than the steps allow: the whole intercept is weights.
    got = fit.fit_calibration(costs, shapes, durations, cm.weight_bytes, 1 / 10e9)
    assert got["overhead_s"] == 0.0
    assert got["s_per_weight_byte"] * cm.weight_bytes == pytest.approx(intercept, rel=1e-6)


def test_robust_fit_ignores_a_step_slowed_by_a_neighbour():
    cm = _cost_model()
    shapes = _shapes()
    costs = [cm.price(s) for s in shapes]
    durations = [0.03 + c.linear_flops / 1e11 + c.kv_read_bytes / 2e9 for c in costs]
    durations[3] *= 3  # another process took the core for this one
    got = fit.fit_calibration(costs, shapes, durations, cm.weight_bytes, 1 / 1e12)
    predicted = [fit.predict(got, c, s) for c, s in zip(costs, shapes)]
    errors = fit.relative_errors(predicted, durations)
    assert np.median(np.delete(errors, 3)) < 0.01  # the clean steps stay exact
    assert errors[3] > 0.5


def test_fit_finds_a_kv_knee_and_the_cost_model_prices_past_it():
    cm = _cost_model()
    layers = cm.model.num_layers
    shapes = [BatchShape.decodes(b, c) for b in (1, 2, 4, 8, 16, 32, 64) for c in (32, 500, 1500)]
    shapes += [BatchShape.prefills(1, n) for n in (16, 128, 512, 1024)]
    costs = [cm.price(s) for s in shapes]
    kv = [c.kv_read_bytes + c.kv_write_bytes for c in costs]
    knee = sorted(kv)[len(kv) // 2] / layers  # a knee at one of the steps' sizes
    truth = {"overhead_s": 0.03, "per_seq_s": 0.0, "s_per_weight_byte": 0.0}
    truth |= {"s_per_linear_flop": 1 / 60e9, "s_per_attention_flop": 0.0, "s_per_kv_byte": 1e-10}
    truth |= {"kv_knee_bytes_per_layer": knee, "s_per_kv_byte_over_knee": 4e-10}
    durations = [fit.predict(truth, c, s, layers) for c, s in zip(costs, shapes)]
    got = fit.fit_calibration(costs, shapes, durations, cm.weight_bytes, 1e-15, layers)
    assert got["kv_knee_bytes_per_layer"] == pytest.approx(knee)
    assert got["s_per_kv_byte_over_knee"] == pytest.approx(4e-10, rel=1e-6)
    assert got["s_per_kv_byte"] == pytest.approx(1e-10, rel=1e-6)
    # Without the knee in the data, none is fitted.
    plain = [0.03 + c.linear_flops / 60e9 + k * 1e-10 for c, k in zip(costs, kv)]
    assert "kv_knee_bytes_per_layer" not in fit.fit_calibration(
        costs, shapes, plain, cm.weight_bytes, 1e-15, layers
    )
    # The cost model reads the knee from the hardware file and prices with it.
    spec = HardwareSpec("k", {"float32": 1e11}, 1e10, 1e10, calibration=got)
    priced = CostModel(cm.model, spec)
    for s, d in zip(shapes, durations):
        assert priced.price(s).predicted_s == pytest.approx(d, rel=1e-6)


def test_error_summary_is_median_and_p90_of_relative_errors():
    measured = [1.0] * 10
    predicted = [1.0 + 0.01 * i for i in range(10)]  # errors 0 .. 9%
    summary = fit.error_summary(predicted, measured)
    assert summary["steps"] == 10
    assert summary["median"] == pytest.approx(0.045)
    assert summary["p90"] == pytest.approx(np.quantile(np.arange(10) * 0.01, 0.9))


# -- a real (tiny) calibration ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_calibration(tmp_path_factory, model_dir):
    from quill.cost import calibrate

    tmp = tmp_path_factory.mktemp("calibrate")
    write_tiny_config(tmp, model_dir)
    out, steps = tmp / "hw.json", tmp / "steps.jsonl"
    threads = torch.get_num_threads()
    try:
        rc = calibrate.main(
            [
                *("--model", str(tmp), "--load-format", "dummy", "--tokenizer", str(model_dir)),
                *("--dtype", "float32", "--device", "cpu", "--threads", "1", "--quick"),
                *("--max-batch", "3", "--max-context", "40", "--max-chunk", "24"),
                *("--steps", "2", "--warmup", "0", "--no-progress"),
                *("--out", str(out), "--save-steps", str(steps), "--tp-sizes", "2"),
            ]
        )
    finally:
        torch.set_num_threads(threads)  # calibrate sets the process-wide pool
    assert rc == 0
    records = [json.loads(line) for line in steps.read_text().splitlines()]
    return tmp, out, records


def test_calibrate_writes_a_hardware_file_that_loads(tiny_calibration):
    _, out, _ = tiny_calibration
    spec = HardwareSpec.load(out)
    assert set(CALIBRATION_KEYS) <= set(spec.calibration)
    assert all(
        spec.coefficients[k] >= 0 and math.isfinite(spec.coefficients[k]) for k in spec.coefficients
    )
    assert spec.calibration["dtype"] == "float32"
    assert spec.calibration["fitted_steps"] > len(CALIBRATION_KEYS)
    assert spec.flops["float32"] > 0 and spec.flops["bfloat16"] > 0
    assert spec.memory_bandwidth > 0 and spec.memory_capacity > 0
    assert spec.step_overhead_s >= 0
    assert isinstance(spec.calibration["cpu_flags"], list) and spec.calibration["cpu_model"]
    assert spec.calibration["date"]
    # The all-reduce among 2 ranks on this host: a median time per payload (the tiny model's
    # 64 floats per token, 1 to 512 tokens), and the line through them.
    allreduce = spec.host_allreduce["2"]
    assert [p[0] for p in allreduce["points"]] == [64 * 4 * n for n in (1, 4, 16, 64, 256, 512)]
    assert all(0 < t < 1 for _, t in allreduce["points"])
    assert allreduce["latency_s"] >= 0 and allreduce["bandwidth"] > 0
    assert spec.allreduce_on_host(2) == (allreduce["latency_s"], allreduce["bandwidth"])


def test_sweep_steps_have_the_shapes_asked_for(tiny_calibration):
    _, _, records = tiny_calibration
    by_case: dict[str, list[dict]] = {}
    for r in records:
        by_case.setdefault(r["case"], []).append(r)
    # Decodes at a fast-forwarded context: every sequence decodes one token past its prompt.
    decodes = by_case["3 dec @ 40"]
    assert len(decodes) == 2
    for r in decodes:
        assert r["kind"] == "decode" and len(r["seqs"]) == 3
        assert all(n == 1 and is_decode and start >= 40 for start, n, _, is_decode in r["seqs"])
    # A later chunk of a prompt: its first 40 tokens were fast-forwarded, 24 are computed.
    (chunked,) = [k for k in by_case if k.endswith("chunk @ 40")]
    for r in by_case[chunked]:
        assert r["seqs"] == [[40, 24, True, False]]
    mixed = [r for r in records if r["kind"] == "mixed"]
    assert mixed and all(r["duration"] > 0 for r in records)


def test_calibrated_prediction_is_the_additive_formula(tiny_calibration):
    tmp, out, records = tiny_calibration
    spec = HardwareSpec.load(out)
    model = ModelSpec.from_path(tmp, bytes_per_param=4)
    model.dtype = "float32"
    c = spec.coefficients
    for record in records:
        seqs = [tuple(s) for s in record["seqs"]]
        tokens = sum(n for _, n, _, _ in seqs)
        sampled = sum(1 for _, _, samples, _ in seqs if samples)
        pairs = sum(n * start + n * (n + 1) // 2 for start, n, _, _ in seqs)
        kv_tokens = sum(start + n for start, n, _, _ in seqs) + tokens  # read + written
        kv_bytes = model.kv_bytes_per_token * kv_tokens
        knee = c.get("kv_knee_bytes_per_layer", 0.0) * model.num_layers
        # Products of few rows run slower: the measured rate at this many rows, log-interpolated.
        rates = spec.matmul_rates
        best = max(r for _, r in rates["layers"])

        def slowdown(curve, rows, best=best):
            t, r = np.array(curve, dtype=float).T
            return best / np.interp(math.log2(rows), np.log2(t), r) if rows else 1.0

        linear = model.linear_flops(tokens, 0) * slowdown(rates["layers"], tokens)
        lm_head = model.linear_flops(0, sampled) * slowdown(rates["lm_head"], sampled)
        by_hand = (
            c["overhead_s"]
            + c["per_seq_s"] * len(seqs)
            + c["s_per_weight_byte"] * model.weight_bytes
            + c["s_per_linear_flop"] * (linear + lm_head)
            + c["s_per_attention_flop"] * model.attention_flops(pairs)
            + c["s_per_kv_byte"] * kv_bytes
            + c.get("s_per_kv_byte_over_knee", 0.0) * max(0.0, kv_bytes - knee)
        )
        priced = CostModel(model, spec).price(BatchShape.from_seqs(seqs))
        assert priced.predicted_s == pytest.approx(by_hand, rel=1e-12)
        assert priced.predicted_s > 0


# The coefficients a recorded serving stream is timed by (tests of `--from-steps`).
REFIT_TRUTH = {
    "overhead_s": 0.02,
    "per_seq_s": 0.001,
    "s_per_weight_byte": 0.0,
    "s_per_linear_flop": 1 / 50e9,
    "s_per_attention_flop": 1 / 20e9,
    "s_per_kv_byte": 1 / 4e9,
}


def _timed_base(tmp_path, model_dir) -> CostModel:
    """A tiny model in `tmp_path` and its base calibration (`base.json`, REFIT_TRUTH): the cost
    model that times the steps a test records."""
    write_tiny_config(tmp_path, model_dir)
    info = {"model_path": str(tmp_path), "dtype": "float32"}
    base = HardwareSpec("cpu", {"float32": 1e11}, 1e10, 8e9, calibration={**REFIT_TRUTH, **info})
    base.save(tmp_path / "base.json")
    model = ModelSpec.from_path(tmp_path, bytes_per_param=4)
    model.dtype = "float32"
    return CostModel(model, base)


def test_refit_on_recorded_steps_recovers_the_coefficients(tmp_path, model_dir):
    """`--from-steps`: a serving engine's own record, timed by known coefficients."""
    from quill.cost.calibrate import main as calibrate_main

    timed = _timed_base(tmp_path, model_dir)
    model, truth = timed.model, REFIT_TRUTH
    rng = np.random.default_rng(3)
    with (tmp_path / "steps.jsonl").open("w") as f:
        for step in range(60):
            batch = int(rng.integers(1, 40))
            seqs = [[int(rng.integers(0, 900)), 1, True, True] for _ in range(batch)]
            if step % 3 == 0:
                seqs.append([0, int(rng.integers(16, 400)), True, False])
            duration = timed.price(BatchShape.from_seqs(seqs)).predicted_s
            f.write(json.dumps({"step": step, "duration": duration, "seqs": seqs}) + "\n")
    out = tmp_path / "serving.json"
    args = ["--from-steps", str(tmp_path / "steps.jsonl"), "--base", str(tmp_path / "base.json")]
    assert calibrate_main([*args, "--out", str(out)]) == 0
    fitted = HardwareSpec.load(out)
    assert fitted.calibration["fitted_steps"] == 60
    for key in ("per_seq_s", "s_per_linear_flop", "s_per_attention_flop", "s_per_kv_byte"):
        assert fitted.coefficients[key] == pytest.approx(truth[key], rel=1e-3), key
    # The intercept is split into weight streaming and a fixed cost; their sum is what's fitted.
    intercept = (
        fitted.coefficients["overhead_s"]
        + model.weight_bytes * fitted.coefficients["s_per_weight_byte"]
    )
    assert intercept == pytest.approx(0.02, rel=1e-3)
    assert calibrate_main(args) == 2  # --out is required


def test_the_serving_refit_measures_how_long_strays_last_and_says_so(tmp_path, model_dir, capsys):
    """`--from-steps` on a record whose steps stray in patches (a level of 70% of each stray
    lasting 0.5 s, steps 20 ms apart) keeps the memory it finds (quill/sim/jitter.py draws
    with it) and says so."""
    import random

    from quill.cost.calibrate import main as calibrate_main

    timed = _timed_base(tmp_path, model_dir)
    rng = random.Random(4)
    keep, level, start = math.exp(-0.02 / 0.5), 0.0, 0.0
    with (tmp_path / "steps.jsonl").open("w") as f:
        for step in range(1500):
            seqs = [[rng.randrange(900), 1, True, True] for _ in range(rng.randint(1, 30))]
            level = keep * level + math.sqrt(1 - keep * keep) * rng.gauss(0, 1)
            score = math.sqrt(0.7) * level + math.sqrt(0.3) * rng.gauss(0, 1)
            price = timed.price(BatchShape.from_seqs(seqs)).predicted_s
            record = {"step": step, "start": start, "duration": price * math.exp(0.1 * score)}
            f.write(json.dumps({**record, "seqs": seqs}) + "\n")
            start += 0.02
    out = tmp_path / "serving.json"
    args = ["--from-steps", str(tmp_path / "steps.jsonl"), "--base", str(tmp_path / "base.json")]
    assert calibrate_main([*args, "--out", str(out)]) == 0
    memory = HardwareSpec.load(out).calibration["step_time_memory"]
    assert memory["shared"] == pytest.approx(0.7, abs=0.15) and 0.25 < memory["seconds"] < 1.0
    assert "slow steps come in patches: " in capsys.readouterr().out
