"""A step may give a request several tokens (speculative decoding's accepted drafts): the
scheduler appends them in order, stops at the first that ends the request, and the front end
turns them into text like tokens that came one by one."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from quill import SamplingParams
from quill.contract.plan import StepPlan, StepResult
from quill.engine.clock import VirtualClock
from quill.engine.core import EngineCore
from quill.engine.kv_cache import KVCacheManager
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler


class _ScriptedExecutor:
    """Hands out, per sampling request and step, the next list of tokens from a script."""

    def __init__(self, clock: VirtualClock, script: dict[str, list[list[int]]]) -> None:
        self.clock = clock
        self.script = {rid: list(steps) for rid, steps in script.items()}
        self.plans: list[StepPlan] = []

    def execute(self, plan: StepPlan) -> StepResult:
        self.plans.append(plan)
        self.clock.advance(0.25)
        return StepResult(
            {s.request_id: self.script[s.request_id].pop(0) for s in plan.seqs if s.samples}
        )


def _run(script, requests):
    clock = VirtualClock()
    executor = _ScriptedExecutor(clock, script)
    core = EngineCore(Scheduler(KVCacheManager(32, 4), 64, 4, 64), executor, clock)
    for r in requests:
        core.add_request(r)
    advanced, finished = [], {}
    while core.has_unfinished_requests():
        out = core.step()
        advanced.append({r.request_id for r in out.advanced})
        finished.update({r.request_id: r for r in out.finished})
    return executor, advanced, finished


def test_several_tokens_in_one_step_are_appended_in_order():
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    script = {"a": [[7], [8, 9, 10], [11, 12]]}
    executor, advanced, finished = _run(script, [Request("a", [1, 2, 3], params, 0.0, 6)])
    a = finished["a"]
    assert a.output_token_ids == [7, 8, 9, 10, 11, 12]
    assert a.finish_reason == "length"
    # Tokens that came without their keys and values are computed by the next step, all of
    # them, from the first position not yet in the cache.
    starts = [(p.seqs[0].start, p.seqs[0].token_ids) for p in executor.plans]
    assert starts == [(0, [1, 2, 3]), (3, [7]), (4, [8, 9, 10])]
    # Every token counts for the timings: 6 tokens, the first at the end of step 1.
    assert a.times.first_token == 0.25 and a.times.num_itl == 5


def test_the_first_ending_token_ends_the_request_and_the_rest_are_dropped():
    eos = 99
    stop_params = SamplingParams(max_tokens=20, stop_token_ids=[55])
    script = {
        "eos": [[5], [6, eos, 7]],  # eos in the middle: 7 is never the request's
        "stop": [[5, 55, 8]],  # a stop token id: kept as the stop reason, 8 dropped
        "cap": [[5], [6, 7, 8, 9]],  # max_tokens 3: the list is cut at the limit
    }
    requests = [
        Request("eos", [1, 2], SamplingParams(max_tokens=20), 0.0, 20, frozenset({eos})),
        Request("stop", [1, 2], stop_params, 0.0, 20, frozenset({eos})),
        Request("cap", [1, 2], SamplingParams(max_tokens=3), 0.0, 3, frozenset({eos})),
    ]
    _, _, finished = _run(script, requests)
    assert finished["eos"].output_token_ids == [5, 6, eos]
    assert (finished["eos"].finish_reason, finished["eos"].stop_reason) == ("stop", None)
    assert finished["stop"].output_token_ids == [5, 55]
    assert (finished["stop"].finish_reason, finished["stop"].stop_reason) == ("stop", 55)
    assert finished["cap"].output_token_ids == [5, 6, 7]
    assert finished["cap"].finish_reason == "length"


def test_min_tokens_holds_back_an_end_token_inside_the_list():
    eos = 99
    params = SamplingParams(max_tokens=10, min_tokens=3)
    script = {"a": [[eos, eos], [4, eos]]}  # the first two ends come before min_tokens
    _, _, finished = _run(script, [Request("a", [1], params, 0.0, 10, frozenset({eos}))])
    assert finished["a"].output_token_ids == [eos, eos, 4, eos]
    assert finished["a"].finish_reason == "stop"


@settings(max_examples=150, deadline=None)
@given(
    steps=st.lists(st.lists(st.integers(5, 9), min_size=1, max_size=4), min_size=1, max_size=6),
    min_tokens=st.integers(0, 6),
    max_tokens=st.integers(1, 12),
    ignore_eos=st.booleans(),
    stop_ids=st.sets(st.integers(5, 9), max_size=2),
    max_model_len=st.integers(4, 16),
)
def test_a_request_ends_at_the_first_token_the_rules_end_it_at(
    steps, min_tokens, max_tokens, ignore_eos, stop_ids, max_model_len
):
    """`update` checks every token without a call where nothing can end the request; the
    request must still end exactly where the rules say: an end id (9 here, unless ignored) or
    a stop id once min_tokens are out, else max_tokens, else the context length."""
    prompt = [1, 2]
    params = SamplingParams(max_tokens=max_tokens, min_tokens=min(min_tokens, max_tokens),
                            ignore_eos=ignore_eos, stop_token_ids=sorted(stop_ids))  # fmt: skip
    expected, reason = [], None
    for token in [t for step in steps for t in step]:
        expected.append(token)
        n = len(expected)
        if n >= params.min_tokens and not ignore_eos and token == 9:
            reason = ("stop", None)
        elif n >= params.min_tokens and token in stop_ids:
            reason = ("stop", token)
        elif n >= max_tokens or len(prompt) + n >= max_model_len:
            reason = ("length", None)
        if reason:
            break
    clock = VirtualClock()
    script = {"a": [list(s) for s in steps] + [[5]] * 16}
    core = EngineCore(
        Scheduler(KVCacheManager(32, 4), 64, 4, max_model_len),
        _ScriptedExecutor(clock, script),
        clock,
    )
    core.add_request(Request("a", prompt, params, 0.0, max_tokens, frozenset({9})))
    ended = []
    for _ in range(len(steps)):
        ended += core.step().finished
        if ended:
            break
    if reason is None:
        assert not ended
        assert core.scheduler.requests["a"].output_token_ids == expected
    else:
        (a,) = ended
        assert a.output_token_ids == expected
        assert (a.finish_reason, a.stop_reason) == reason
