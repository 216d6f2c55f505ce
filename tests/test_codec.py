"""The messages between the API process and the engine process survive the wire unchanged.

Property test: any step plan, engine request, step's outputs, refusal or utility call that
the contract can describe, encoded by quill.contract.codec and decoded on the other side, is
equal to what was sent (msgspec decodes into the same dataclasses, types checked).
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.contract.codec import Codec
from quill.contract.constraint import KINDS, Constraint
from quill.contract.messages import (
    AbortRequests,
    AddResult,
    EngineFailed,
    EngineInfo,
    EngineOutputs,
    EngineRequest,
    ErrorInfo,
    RequestUpdate,
    StepPrice,
    StepStats,
    UtilityCall,
    UtilityResult,
)
from quill.contract.outputs import RequestMetrics
from quill.contract.plan import SeqPlan, StepPlan
from quill.contract.sampling_params import SamplingParams

ids = st.text(min_size=1, max_size=12)
tokens = st.lists(st.integers(0, 200_000), max_size=20)
times = st.floats(0, 1e6, allow_nan=False, allow_subnormal=False)
maybe_time = st.none() | times
logprob = st.floats(
    max_value=0, allow_nan=False, allow_subnormal=False
)  # -inf included: a barred token

params = st.builds(
    SamplingParams,
    max_tokens=st.none() | st.integers(1, 4096),
    temperature=st.floats(0, 2, allow_subnormal=False),
    top_p=st.floats(0.01, 1, allow_subnormal=False),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1, allow_subnormal=False),
    repetition_penalty=st.floats(0.5, 2, allow_subnormal=False),
    presence_penalty=st.floats(-2, 2, allow_subnormal=False),
    frequency_penalty=st.floats(-2, 2, allow_subnormal=False),
    seed=st.none() | st.integers(-(2**63), 2**63 - 1),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=3),
    stop_token_ids=tokens,
    ignore_eos=st.booleans(),
    logprobs=st.none() | st.integers(0, 20),
    min_tokens=st.integers(0, 10),
    include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans(),
    logit_bias=st.none()
    | st.dictionaries(st.integers(0, 49151), st.floats(-100, 100, allow_subnormal=False)),
    structured=st.none() | st.builds(Constraint, st.sampled_from(KINDS), st.text(max_size=20)),
)


@st.composite
def seq_plans(draw) -> SeqPlan:
    samples = draw(st.booleans())
    history = draw(st.booleans())
    return SeqPlan(
        draw(ids),
        draw(tokens.filter(bool)),
        draw(st.integers(0, 10_000)),
        draw(st.integers(1, 10_000)),
        draw(st.lists(st.lists(st.integers(-1, 1 << 20), max_size=10), min_size=1, max_size=3)),
        samples,
        draw(params) if samples else None,
        draw(tokens) if history else None,
        draw(tokens) if history else None,
    )


plans = st.builds(StepPlan, st.integers(0, 1 << 40), st.lists(seq_plans(), max_size=6),
                  st.lists(ids, max_size=4))  # fmt: skip

metrics = st.builds(
    RequestMetrics,
    arrival_time=times,
    queue_time=maybe_time,
    time_to_first_token=maybe_time,
    mean_inter_token_latency=maybe_time,
    max_inter_token_latency=maybe_time,
    prefill_time=maybe_time,
    decode_time=maybe_time,
    e2e_latency=maybe_time,
    num_prompt_tokens=st.integers(0, 1 << 20),
    num_generation_tokens=st.integers(0, 1 << 20),
    num_preemptions=st.integers(0, 100),
    num_cached_tokens=st.none() | st.integers(0, 1 << 20),
    predicted_time_to_first_token=maybe_time,
    flops=maybe_time,
    bytes_moved=maybe_time,
    cost_usd=maybe_time,
)
sample_logprobs = st.tuples(logprob, st.lists(st.tuples(st.integers(0, 1 << 17), logprob),
                                               max_size=5))  # fmt: skip
updates = st.builds(
    RequestUpdate,
    request_id=ids,
    new_token_ids=tokens,
    metrics=metrics,
    new_logprobs=st.none() | st.lists(sample_logprobs, max_size=4),
    finish_reason=st.sampled_from([None, "stop", "length", "abort", "error"]),
    stop_reason=st.none() | st.integers(0, 1 << 17) | st.text(max_size=5),
    error=st.none() | st.text(max_size=20),
)
prices = st.builds(StepPrice, *[times] * 7, st.none() | times)
stats = st.builds(
    StepStats,
    *[st.integers(0, 1 << 20)] * 5,
    st.floats(0, 1, allow_subnormal=False),
    st.integers(0, 100),
    times,
    st.integers(0, 1 << 40),
    st.integers(0, 1 << 40),
    st.none() | prices,
)
messages = st.one_of(
    plans,
    st.builds(EngineRequest, ids, tokens, params, times, st.integers(1, 1 << 20),
              st.integers(-100, 100), st.none() | st.text(max_size=8), maybe_time),  # fmt: skip
    st.builds(AbortRequests, st.lists(ids, max_size=5), st.sampled_from(["abort", "stop"])),
    st.builds(EngineOutputs, st.lists(updates, max_size=5), st.none() | stats),
    st.builds(AddResult, ids, st.none() | st.builds(ErrorInfo, st.sampled_from(
        ["invalid", "overloaded", "engine"]), st.text(), st.none() | st.text(), maybe_time)),
    st.builds(UtilityCall, st.integers(0, 1 << 30), st.text(min_size=1),
              st.lists(st.integers(-(2**63), 2**63 - 1) | st.text(), max_size=3)),
    st.builds(UtilityResult, st.integers(-1, 1 << 30),
              st.none() | st.dictionaries(st.text(), st.integers(0, 1 << 30) | times),
              st.none() | st.text()),
    st.builds(EngineInfo, st.text(), st.text(), tokens, st.integers(1, 1 << 20),
              st.integers(1, 1 << 20), st.integers(1, 1 << 30), st.integers(0, 1 << 22),
              st.none() | st.text(), st.none() | times),
    st.builds(EngineFailed, st.text(), st.booleans()),
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(messages)
def test_every_message_round_trips_unchanged(message):
    codec = Codec()
    data = codec.encode(message)
    assert isinstance(data, bytes)
    back = Codec().decode(data)  # the other side has its own codec
    assert type(back) is type(message)
    assert back == message


def test_a_step_plan_keeps_its_sampling_parameters_typed():
    plan = StepPlan(7, [SeqPlan("a", [1, 2], 0, 2, [[3]], True, SamplingParams(temperature=0))])
    back = Codec().decode(Codec().encode(plan))
    assert isinstance(back.seqs[0].sampling_params, SamplingParams)
    assert back.seqs[0].sampling_params.greedy and back.num_decode_tokens == 0


def test_anything_else_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match="not a quill message"):
        Codec().encode({"plain": "dict"})
    data = Codec().encode(AbortRequests(["a"]))
    forged = data.replace(b"AbortRequests", b"AbortRequestZ")
    with pytest.raises(ValueError, match="unknown message type"):
        Codec().decode(forged)
