"""The simulator against the real engine, small and loose (the full validation is
benchmarks/bench_sim_validation.py): the default model's engine (in this process, no HTTP)
records its steps on one burst of requests; the step model refitted on them (the serving
refit of `quill cost calibrate --from-steps`) simulates another burst, of other lengths, which
the engine then serves; each request's TTFT and end-to-end latency, and the burst's length,
agree within a loose bound (20%; 2% on this machine: the engine in this process, no HTTP)."""

from __future__ import annotations

import random
import statistics

import pytest

from quill import LLM, SamplingParams
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.refit import recorded_steps, refit_spec, step_gaps
from quill.engine.record import read_steps
from quill.sim.cluster import run_colocated
from quill.sim.config import SimConfig
from quill.sim.workload import WorkItem

# The refit keeps only the base's rates, as the units of the terms it fits: round figures of
# a 2-core CPU will do.
BASE = HardwareSpec(
    name="2-core CPU (the refit's units)",
    flops={"float32": 2e11},
    memory_bandwidth=2e10,
    memory_capacity=24e9,
)
LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=256)


def _burst(seed: int, n: int = 16) -> list[WorkItem]:
    rng = random.Random(seed)
    return [WorkItem(str(i), 0.0, rng.randint(16, 200), rng.randint(4, 40)) for i in range(n)]


def _serve(llm: LLM, items: list[WorkItem], seed: int) -> list:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(i.prompt_tokens)] for i in items]
    params = [SamplingParams(max_tokens=i.output_tokens, ignore_eos=True, temperature=0)
              for i in items]  # fmt: skip
    return llm.generate(prompts, params, use_tqdm=False)


def test_a_held_out_burst_as_the_engine_serves_it(tmp_path, model_dir):
    steps_file = tmp_path / "steps.jsonl"
    kv_memory = 64 << 20
    llm = LLM(str(model_dir), dtype="float32", quantization="none", kv_cache_dtype="float32",
              kv_cache_memory=kv_memory, record_steps=str(steps_file), **LIMITS)  # fmt: skip
    try:
        _serve(llm, _burst(1, 4), 0)  # warm-up, not fitted
        warm = len(read_steps(steps_file))
        _serve(llm, _burst(2), 1)  # the steps the model is fitted on
        fitted = len(read_steps(steps_file))
        held_out = _burst(3)
        real = _serve(llm, held_out, 2)
    finally:
        llm.close()
    model = ModelSpec.from_path(model_dir, bytes_per_param=4)
    model.kv_bytes_per_element = 4
    steps = recorded_steps(steps_file)
    hardware = refit_spec(BASE, model, steps[warm:fitted])
    hardware.calibration["step_gap"] = step_gaps(read_steps(steps_file)[warm:fitted])
    config = SimConfig.create(model, hardware, kv_cache_memory=kv_memory, **LIMITS)
    sim = run_colocated(config, held_out)["results"]

    ttft = [o.metrics.time_to_first_token for o in real]
    e2e = [o.metrics.e2e_latency for o in real]
    assert sim["num_requests"] == len(real) and sim["num_preemptions"] == 0
    # The burst's requests queue behind each other: both the first tokens' spread and the
    # last reply's end are the schedule's, not one step's.
    for figure, values in (("ttft_ms", ttft), ("e2e_ms", e2e)):
        assert sim[figure]["mean"] / 1e3 == pytest.approx(statistics.mean(values), rel=0.2)
        assert sim[figure]["max"] / 1e3 == pytest.approx(max(values), rel=0.2)
