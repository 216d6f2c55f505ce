"""The pure parts of `quill bench experiments`: hand-checked arithmetic, the report builder,
and the interference script on the simulator. No real model runs here (seconds, not minutes).
"""

from __future__ import annotations

import json
import math

import pytest

from quill.bench.experiments import batching, cost, interference, load, reading, split
from quill.bench.experiments.report import Section, Table, render_report
from quill.bench.experiments.scenario import Script, SimSide, play, stream_ids
from quill.bench.experiments.stats import (
    gap_stats,
    integrate_steps,
    per_million,
    percentile_or_none,
)
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel

COEFFICIENTS = {
    "overhead_s": 0.01,
    "per_seq_s": 0.001,
    "s_per_weight_byte": 1e-11,
    "s_per_linear_flop": 0.0,
    "s_per_attention_flop": 0.0,
    "s_per_kv_byte": 0.0,
}


def toy(calibrated: bool = False) -> CostModel:
    """1e9 weights of 2 bytes (2 FLOPs each per token, all read once per pass, no KV) on a
    device of 1 TFLOP/s and 100 GB/s: every figure below is worked out by hand."""
    model = ModelSpec.abstract(1e9, 2)
    hardware = HardwareSpec(
        "toy",
        {"bfloat16": 1e12},
        memory_bandwidth=1e11,
        memory_capacity=math.inf,
        calibration=dict(COEFFICIENTS) if calibrated else None,
    )
    return CostModel(model, hardware)


# -- experiment 1: the course's table ----------------------------------------------------------
def test_course_rows_by_hand():
    rows = reading.course_rows(toy(), [100])
    read, write = rows[0]["read"], rows[0]["write"]
    # Reading 100 tokens: one pass, 2e9 x 100 FLOPs at 1e12/s, 2e9 bytes at 1e11/s.
    assert read["passes"] == 1
    assert read["flops"] == pytest.approx(2e11)
    assert read["arithmetic_s"] == pytest.approx(0.2)
    assert read["movement_s"] == pytest.approx(0.02)
    assert read["bound"] == "arithmetic"
    assert read["time_s"] == pytest.approx(0.2)  # uncalibrated: the roofline, no overhead
    # Writing 100 tokens: 100 passes, each 2e9 FLOPs (2 ms) and the 2e9 bytes again (20 ms).
    assert write["passes"] == 100
    assert write["arithmetic_s"] == pytest.approx(0.2)
    assert write["movement_s"] == pytest.approx(2.0)
    assert write["bound"] == "movement"
    assert write["ops_per_byte"] == pytest.approx(1.0)


def test_integrate_steps_reads_the_line_through_measured_points():
    points = [(10, 2.0), (0, 1.0)]  # any order
    assert integrate_steps(points, 0, 3) == pytest.approx(1.0 + 1.1 + 1.2)
    assert integrate_steps(points, 10, 2) == pytest.approx(2.0 + 2.1)  # past the last point
    assert integrate_steps([(5, 0.5)], 0, 4) == pytest.approx(2.0)  # one point: constant
    with pytest.raises(ValueError):
        integrate_steps([], 0, 1)


# -- experiment 3: cost per token ----------------------------------------------------------------
def test_per_million_arithmetic():
    out = per_million(0.05, price_per_hour=0.10)  # 50 ms a token
    assert out["seconds_per_million"] == pytest.approx(50_000)
    assert out["hours_per_million"] == pytest.approx(50_000 / 3600)
    assert out["usd_per_million"] == pytest.approx(50_000 / 3600 * 0.10)


def test_split_and_sharing_fraction_by_hand():
    cm = toy(calibrated=True)
    # A decode step of B: 10 ms fixed + 2e9 weight bytes x 1e-11 s (20 ms) shared, 1 ms each.
    quiet, busy = cost.split(cm, 1, 128), cost.split(cm, 10, 128)
    assert quiet["shared_s"] == pytest.approx(0.03)
    assert quiet["own_s"] == pytest.approx(0.001)
    assert busy["predicted_s"] == pytest.approx(0.04)
    assert busy["own_s"] == pytest.approx(0.01)
    # Per token 31 ms against 4 ms; sharing saves 30 - 3 = 27 ms of the 27: all of it.
    assert cost.sharing_fraction(quiet, busy) == pytest.approx(1.0)


# -- experiment 4: gaps and stalls ---------------------------------------------------------------
def test_gap_stats_on_hand_made_token_times():
    times = {
        "a": [0.0, 1.0, 2.0, 6.0, 7.0],  # gaps 1, 1, 4, 1
        "b": [0.5, 1.5, 2.5, 5.5, 6.5],  # gaps 1, 1, 3, 1
        "new": [5.2],
    }
    stats = gap_stats(times, ["a", "b"], arrival=2.2, first_token=5.2)
    assert stats["num_gaps"] == 8
    assert stats["longest_stall_s"] == 4.0
    assert stats["p50_s"] == 1.0
    # Sorted 1 1 1 1 1 1 3 4: rank 7 x 0.99 = 6.93 lies 0.93 of the way from 3 to 4.
    assert stats["p99_s"] == pytest.approx(3.93)
    assert stats["ttft_s"] == pytest.approx(3.0)
    assert stats["before_arrival_p50_s"] == 1.0  # gaps ending at 1, 2 and 1.5
    assert stats["after_arrival_p50_s"] == 1.0  # 4, 1, 1, 3, 1
    assert stats["after_first_token_p50_s"] == pytest.approx(2.0)  # 4, 1, 3, 1
    assert gap_stats(times, ["a"], 0.0, None)["ttft_s"] is None
    assert percentile_or_none([], 99) is None


def test_interference_script_on_the_simulator():
    from quill.sim.config import SimConfig

    model = ModelSpec.preset("SmolLM2-135M", 4)
    model.dtype = "float32"
    hardware = HardwareSpec(
        "toy cpu", {"float32": 1e11}, memory_bandwidth=2e10, memory_capacity=16e9
    )
    script = Script(steps_before=2, steps_after=2)
    stalls = {}
    for name, budget in interference.budgets(script).items():
        config = SimConfig.create(
            model, hardware, max_num_batched_tokens=budget, kv_cache_memory=1 << 30
        )
        timeline = play(SimSide(config), script)
        stats = interference.timeline_summary(timeline, script)["stats"]
        stalls[name] = stats["longest_stall_s"]
        # Every stream decodes in every step once it started; the newcomer got its token.
        assert stats["ttft_s"] > 0
        expected = 1 if name == "one_pass" else math.ceil(2000 / (256 - script.streams))
        assert stats["prompt_steps"] == expected
        assert set(stream_ids(script)) <= set(timeline.token_times)
    assert stalls["chunked"] < stalls["one_pass"] / 3


# -- the report ----------------------------------------------------------------------------------
def test_render_report_from_a_fake_section():
    section = Section(
        "fake",
        "A fake experiment",
        "What it shows.",
        [Table(["x", "y"], [["1", "2 ms"]], "a note")],
        "fake.png",
        "The caption, 2 ms.",
        "The reading, from the numbers.",
    )
    header = {
        "date": "2026-01-01",
        "command": "quill bench experiments --quick",
        "quick": True,
        "machine": {"cpu_model": "Toy CPU", "simd_flags": ["avx2"], "cores_available": 2},
        "calibration": {"source": "given", "path": "hw.json"},
        "model": "toy",
        "notes": ["A note."],
    }
    meta = {"date": "2026-01-01", "command": "cmd", "quick": True, "seconds": 12.0}
    text = render_report(header, [(section, meta)], figures="figs")
    assert text.startswith("# Experiments")
    assert "Toy CPU" in text and "avx2" in text and "no avx512f" in text
    assert "`quill bench experiments --quick`" in text
    assert "## 1. A fake experiment" in text
    assert "| x | y |\n|---|---|\n| 1 | 2 ms |" in text
    assert "![A fake experiment](figs/fake.png)" in text
    assert "*Figure 1.* The caption, 2 ms." in text
    assert "**Reading.** The reading, from the numbers." in text
    assert "quick run, took 12.0 s" in text


def _step(measured: float, predicted: float, roofline: float) -> dict:
    return {
        "measured_s": measured,
        "predicted_s": predicted,
        "roofline_s": roofline,
        "bound": "movement",
        "flops": 1e9,
        "bytes": 5e8,
        "kv_bytes": 1e8,
    }


def fake_results() -> dict[str, dict]:
    """Small results in each experiment's stored format."""
    rows = reading.course_rows(toy(), [16, 64])
    for row in rows:
        row["read"]["measured_s"] = row["read"]["time_s"] * 1.1
        row["write"]["measured_s"] = row["write"]["time_s"] * 0.9
    read = {
        "rows": rows,
        "decode_steps": [{"context": 16, "measured_s": 0.05, "predicted_s": 0.06}],
        "prefill_steps": [],
        "real_replies": [{"tokens_asked": 16, "write_s": 0.8, "integrated_s": 0.75}],
        "weight_bytes": 2e9,
        "ridge_ops_per_byte": 10.0,
    }
    batch_rows = [
        {"batch": b, **_step(0.05 * b**0.5, 0.05 * b**0.5, 0.02), "tokens_per_s": b / 0.05}
        | {"predicted_tokens_per_s": b / 0.05, "roofline_tokens_per_s": b / 0.02}
        | {"ops_per_byte": 2.0}
        for b in (1, 4)
    ]
    batch = {
        "context": 256,
        "rows": batch_rows,
        "curve": [{"batch": b, **_step(0, 0.05 * b, 0.02 * b)} for b in (1, 2, 4, 8)],
        "arithmetic_from_batch": 23,
        "ridge_ops_per_byte": 7.5,
        "pool_bytes": 4 << 30,
        "pool_tokens": 93200,
        "max_num_seqs": 256,
        "engine_max_batch": 256,
        "cost_model_max_batch": 1875,
        "kv_bytes_per_token": 46080,
        "weight_bytes": 5.4e8,
    }
    cm = toy(calibrated=True)
    loads = [
        {
            "load": load_name,
            "batch": b,
            "measured_step_s": step,
            "predicted_step_s": step * 1.1,
            "measured": per_million(step / b, 0.1),
            "predicted": per_million(step * 1.1 / b, 0.1),
            "split": cost.split(cm, b, 384),
        }
        for load_name, b, step in (("quiet", 1, 0.06), ("busy", 10, 0.2))
    ]
    costs = {
        "prompt_tokens": 256,
        "reply_tokens": 256,
        "context": 384,
        "price_per_hour": 0.1,
        "loads": loads,
        "sharing_fraction": cost.sharing_fraction(loads[0]["split"], loads[1]["split"]),
        "pool_bytes": 4 << 30,
        "max_num_seqs": 256,
        "cost_model_max_batch": None,
    }
    stats = {
        "longest_stall_s": 5.0,
        "p99_s": 4.0,
        "p50_s": 0.15,
        "ttft_s": 5.1,
        "prompt_steps": 1,
        "after_first_token_p50_s": 0.4,
    }
    side = {"stats": stats, "token_times": {"stream-0": [-0.1, 0.0, 5.0]}, "steps": []}
    two = {"itl_p50_s": 0.1, "itl_p99_s": 0.2, "itl_max_s": 5.0, "ttft_max_s": 5.1}
    inter = {
        "script": vars(Script()),
        "runs": {
            "one_pass": {"budget": 2064, "measured": side, "simulated": side},
            "chunked": {"budget": 256, "measured": side, "simulated": side},
        },
        "cluster": {
            "colocated_one_pass": two | {"kv_transfer_s": None},
            "colocated_chunked": two | {"kv_transfer_s": None},
            "disaggregated": two | {"kv_transfer_s": 0.074},
        },
        "cluster_stream_reply": 64,
        "interconnect_bandwidth": 1.25e9,
        "kv_bytes_per_token": 46080,
    }
    figures = {
        "ttft_p50_s": 0.5,
        "ttft_p99_s": 1.0,
        "itl_p50_s": 0.1,
        "itl_p99_s": 0.5,
        "output_tokens_per_s": 20.0,
        "requests_per_s": 0.5,
    }
    loaded = {
        "plan": {"requests": 10, "prompt": 128, "reply": 32, "fractions": [0.5, 1.2]},
        "saturation_rate": 1.0,
        "saturation_rate_calibration": 2.0,
        "serving_fit_steps": 30,
        "serving_fit_error": None,
        "server_flags": [],
        "runs": [
            {"rate": r, "fraction": f, "failed": 0, "server": figures}
            | {"simulated": figures, "simulated_calibration": figures}
            for r, f in ((0.5, 0.5), (1.2, 1.2))
        ],
    }
    side_numbers = {
        "streams_itl_p50_s": 0.08,
        "streams_itl_p99_s": 1.5,
        "streams_longest_stall_s": 1.7,
        "long_ttft_mean_s": 13.0,
        "long_ttft_max_s": 16.0,
        "all_itl_p50_s": 0.08,
        "all_itl_p99_s": 1.5,
        "all_itl_max_s": 1.7,
        "timeline": [[0.1, 0.08], [0.5, 1.5]],
    }
    simulated = {k: v for k, v in side_numbers.items() if k.startswith(("all", "long_ttft_max"))}
    split_result = {
        "workload": [["s0", 0.0, 32, 256], ["new0", 4.0, 2000, 16]],
        "rounds": 2,
        "measured": {
            "colocated": side_numbers,
            "split": side_numbers | {"streams_itl_p99_s": 0.6, "all_itl_p99_s": 0.6},
        },
        "kv_transfers": [{"bytes": 46e6, "seconds": 0.5}],
        "kv_transfer_rate": 92e6,
        "simulated": {"colocated": simulated, "split": simulated | {"all_itl_p99_s": 0.66}},
        "hardware_file": "one-core.json",
    }
    return {
        "reading": read,
        "batching": batch,
        "cost": costs,
        "interference": inter,
        "split": split_result,
        "load": loaded,
    }


@pytest.mark.parametrize("module", [reading, batching, cost, interference, split, load])
def test_each_experiment_describes_its_numbers(module):
    section = module.describe(fake_results()[module.NAME])
    assert section.title == module.TITLE
    assert section.tables and all(t.rows for t in section.tables)
    assert section.figure == f"{module.NAME}.png"
    assert section.caption and section.reading
    assert "None" not in section.reading and "nan" not in section.reading


def test_report_from_stored_results(tmp_path):
    from quill.bench.experiments.driver import write_report

    out = tmp_path / "figures" / "experiments"
    out.mkdir(parents=True)
    meta = {"date": "2026-01-01", "command": "cmd", "quick": True, "seconds": 1.0}
    for name, result in fake_results().items():
        (out / f"{name}.json").write_text(json.dumps({"meta": meta, "result": result}))
    (out / "batching.json").write_text(json.dumps({"meta": meta, "result": {"old": 1}}))
    doc = tmp_path / "experiments.md"
    write_report({"date": "d", "command": "c"}, doc, out)
    text = doc.read_text()
    for number, module in enumerate([reading, batching, cost, interference, split, load], 1):
        assert f"## {number}. {module.TITLE}" in text
    assert "(figures/experiments/reading.png)" in text
    # Numbers in a format this version cannot read leave a pointer, not a crash.
    assert "--only batching" in text


def test_plots_draw_from_the_numbers(tmp_path):
    pytest.importorskip("matplotlib")
    from quill.bench.experiments.figures import PLOTS

    for name, result in fake_results().items():
        PLOTS[name](result, tmp_path / f"{name}.png")
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_cli_rejects_unknown_experiments(capsys):
    from quill.bench.experiments.cli import main

    assert main(["--only", "nonsense"]) == 2
    assert "unknown experiment" in capsys.readouterr().err
