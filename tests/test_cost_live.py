"""Live costs: every step priced beside its measured time, every request charged its share."""

from __future__ import annotations

import pytest

from quill import SamplingParams
from quill.contract.plan import SeqPlan, StepPlan
from quill.cost.hardware import HardwareSpec
from quill.cost.live import CostAccountant, find_calibration
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel

# SmolLM2-135M by hand: 30 layers of q/k/v/o (576x576, 2 x 576x192, 576x576) and a 3 x 576x1536
# MLP; the tied 49152 x 576 embedding maps sampled rows to logits; 9 heads of 64.
LAYER_LINEAR_PARAMS = 30 * (2 * 576 * 576 + 2 * 576 * 192 + 3 * 576 * 1536)
LM_HEAD_PARAMS = 576 * 49152
ATTENTION_FLOPS_PER_PAIR = 4 * 30 * 9 * 64


def request_flops(num_prompt: int, num_output: int, num_cached: int = 0) -> int:
    """A request's FLOPs over its life: every token but the last goes through the layers once
    (but the `num_cached` the prefix cache held), every output token is sampled once, and token
    p attends to p + 1 keys."""
    tokens = num_prompt + num_output - 1
    pairs = tokens * (tokens + 1) // 2 - num_cached * (num_cached + 1) // 2
    return (
        2 * LAYER_LINEAR_PARAMS * (tokens - num_cached)
        + 2 * LM_HEAD_PARAMS * num_output
        + ATTENTION_FLOPS_PER_PAIR * pairs
    )


def test_request_flops_do_not_depend_on_batching(llm):
    prompts = [[11] * 40, [12] * 7, [13] * 25]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    scheduler = llm.engine.scheduler
    for budget in (16, 512):  # chunked into pieces, or each prompt in one pass
        saved, scheduler.token_budget = scheduler.token_budget, budget
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
        finally:
            scheduler.token_budget = saved
        for prompt, out in zip(prompts, outs):
            cached = out.metrics.num_cached_tokens
            if budget == 512:  # the second time: every full block but the last token's is cached
                assert cached == (len(prompt) - 1) // 16 * 16
            assert out.metrics.flops == request_flops(len(prompt), 6, cached)
            assert out.metrics.bytes_moved > 0 and out.metrics.cost_usd is None
    assert llm.engine.accountant.charges == {}  # nothing left behind once requests end


def _plan() -> StepPlan:
    seqs = [
        SeqPlan("a", [1], 10, 10, [[0]], True),  # a decode after 10 tokens
        SeqPlan("b", [1] * 6, 0, 6, [[1]], True),  # a whole 6-token prompt
        # A middle chunk that samples nothing but scores its rows (prompt logprobs).
        SeqPlan("c", [1] * 4, 4, 12, [[2]], False, prompt_logprob_token_ids=[1] * 4),
    ]
    return StepPlan(0, seqs)


def test_shares_add_up_to_the_step_and_split_the_weights():
    model = ModelSpec.preset("SmolLM2-135M")
    hardware = HardwareSpec("test", {"bfloat16": 1e12}, 1e11, 64e9, price_per_hour=3600.0)
    cost_model = CostModel(model, hardware)
    accountant = CostAccountant(model, cost_model)
    accountant.on_step(_plan(), 1.0, 1.5)  # measured 0.5 s at $1/s
    step = accountant.last.cost
    charges = accountant.charges
    assert sum(c.flops for c in charges.values()) == pytest.approx(step.flops)
    assert sum(c.bytes_moved for c in charges.values()) == pytest.approx(step.bytes_moved)
    assert sum(c.cost_usd for c in charges.values()) == pytest.approx(0.5)
    # Hand-worked: "a" is one token at position 10, sampled: attends 11 keys; reads 11 tokens
    # of KV and writes 1; a third of the weights (its batch has three sequences).
    kv_per_token = 2 * 30 * 3 * 64 * 2
    assert charges["a"].flops == 2 * LAYER_LINEAR_PARAMS + 2 * LM_HEAD_PARAMS + 11 * 69120
    weight_bytes = 2 * (LAYER_LINEAR_PARAMS + LM_HEAD_PARAMS + 30 * 2 * 576 + 576)
    assert charges["a"].bytes_moved == pytest.approx(
        weight_bytes / 3 + 12 * kv_per_token + model.activation_bytes(1, 1)
    )
    # "c"'s 4 scored rows are 4 rows of the output head, charged to it.
    assert charges["c"].flops >= model.linear_flops(4, 0) + 4 * 2 * LM_HEAD_PARAMS
    # The step is movement-bound here, so dollars follow bytes.
    assert step.bound == "movement"
    assert charges["a"].cost_usd == pytest.approx(0.5 * charges["a"].bytes_moved / step.bytes_moved)
    mfu, mbu = accountant.utilization(accountant.last)
    assert mfu == pytest.approx(step.flops / (0.5 * 1e12))
    assert mbu == pytest.approx(step.bytes_moved / (0.5 * 1e11))
    assert accountant.last.roofline_efficiency == pytest.approx(step.roofline_s / 0.5)


def test_a_price_without_a_hardware_spec_charges_the_measured_seconds_by_bytes():
    model = ModelSpec.preset("SmolLM2-135M")
    accountant = CostAccountant(model, None, price_per_hour=7200.0)  # $2 a second
    accountant.on_step(_plan(), 1.0, 1.25)
    charges = accountant.charges
    assert accountant.last is None  # no roofline without a spec
    assert sum(c.cost_usd for c in charges.values()) == pytest.approx(0.5)
    moved = sum(c.bytes_moved for c in charges.values())
    assert charges["b"].cost_usd == pytest.approx(0.5 * charges["b"].bytes_moved / moved)


def test_saved_calibration_is_found_by_dtype(tmp_path):
    spec = HardwareSpec("this-cpu", {"float32": 1e11}, 1e10, 8e9)
    spec.save(tmp_path / "cpu-float32.json")
    assert find_calibration("float32", tmp_path).name == "this-cpu"
    assert find_calibration("bfloat16", tmp_path) is None
    assert find_calibration("float32", tmp_path / "missing") is None


def test_observers_off_leave_the_tokens_and_cost_nothing(llm, model_dir):
    """--no-predict-ttft --no-cost-accounting: no observer runs in the step (none is even
    built), the tokens are the same, the request carries no prediction and no charges, and a
    request asking for a TTFT SLO is refused as one this engine cannot keep."""
    from quill import LLM
    from quill.contract.errors import InvalidRequestError

    bare = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_memory=64 << 20,
        predict_ttft=False,
        cost_accounting=False,
    )
    core = bare.engine.worker.core
    assert core.admission is None and core.step_listeners == [] and bare.engine.accountant is None
    prompts = [[11] * 40, [12] * 7]
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = bare.generate(prompts, params, use_tqdm=False)
    want = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in want]
    for out, ref in zip(outs, want):
        assert out.metrics.flops is None and out.metrics.bytes_moved is None
        assert out.metrics.predicted_time_to_first_token is None
        assert ref.metrics.flops > 0 and ref.metrics.predicted_time_to_first_token is not None
    assert bare.engine.last_step.price is None
    with pytest.raises(InvalidRequestError, match="TTFT prediction") as err:
        bare.engine.add_request([1, 2, 3], params, "slo", ttft_slo=1.0)
    assert err.value.param == "ttft_slo"
    with pytest.raises(ValueError, match="predict_ttft"):
        LLM(str(model_dir), predict_ttft=False, max_ttft_slo=0.5)


def test_observer_flags_reach_the_engine_config():
    import argparse

    from quill.config import EngineConfig
    from quill.engine_args import add_engine_arguments, engine_options

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    on = EngineConfig(**engine_options(parser.parse_args([])))
    assert on.predict_ttft and on.cost_accounting
    off = EngineConfig(
        **engine_options(parser.parse_args(["--no-predict-ttft", "--no-cost-accounting"]))
    )
    assert not off.predict_ttft and not off.cost_accounting
