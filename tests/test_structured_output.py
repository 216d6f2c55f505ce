"""Structured output in the engine (quill/structured/matchers.py): every constrained reply of
the default model parses and validates (`jsonschema`, Python's `re`: independent references),
unconstrained requests beside them are untouched, and a bad or slow grammar fails its own
request alone."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import pytest

from quill import SamplingParams
from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
LIST = {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 4}
PROMPTS = ["Describe a person as JSON:", "The capital of France is", "List some numbers:"]


def _params(constraint: Constraint | None, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "temperature": 0, "structured": constraint, **kw})


def test_constrained_replies_validate_and_free_ones_are_untouched(llm):
    free = _params(None, max_tokens=16)
    want_free = llm.generate([PROMPTS[1]], free, use_tqdm=False)[0].outputs[0]
    seeded = dict(temperature=1.0, seed=3)
    params = [
        _params(Constraint.json_schema(PERSON)),
        free,
        _params(Constraint.json_schema(LIST), **seeded),
        _params(Constraint("json_object")),
    ]
    outs = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[0]], params, use_tqdm=False)
    got = [o.outputs[0] for o in outs]
    jsonschema.validate(json.loads(got[0].text), PERSON)
    jsonschema.validate(json.loads(got[2].text), LIST)
    assert isinstance(json.loads(got[3].text), dict)
    assert all(g.finish_reason == "stop" for g in (got[0], got[2], got[3]))
    assert got[1].token_ids == want_free.token_ids  # the masks touched only their own rows


def test_regex_choice_and_a_grammar_that_only_allows_the_end(llm):
    pattern = r"[A-Z][a-z]{2,8}, [0-9]{4}"
    colours = ["red", "green", "blue"]
    params = [
        _params(Constraint("regex", pattern)),
        _params(Constraint.choice(colours)),
        # min_tokens cannot hold a reply the grammar has ended: the grammar wins
        _params(Constraint.choice(["yes"]), min_tokens=10),
    ]
    outs = llm.generate(["A city and a year:", "My favourite colour is", "Say yes:"], params,
                        use_tqdm=False)  # fmt: skip
    assert re.fullmatch(pattern, outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in colours
    assert outs[2].outputs[0].text == "yes" and outs[2].outputs[0].finish_reason == "stop"


def test_a_bad_constraint_is_refused_naming_the_field(llm):
    for constraint, why in [
        (Constraint.json_schema({"type": "frobnicate"}), "frobnicate"),
        (Constraint("regex", "(unclosed"), "regex"),
    ]:
        with pytest.raises(InvalidRequestError, match=why) as e:
            llm.engine.add_request([1, 2, 3], _params(constraint), "bad")
        assert e.value.param == "structured"


def test_a_grammar_past_its_deadline_is_refused_alone(llm, monkeypatch):
    matchers = llm.engine.core.structured
    slow_prepare = matchers._prepare

    def slow(constraint):
        time.sleep(0.5)
        return slow_prepare(constraint)

    monkeypatch.setattr(matchers, "_prepare", slow)
    monkeypatch.setattr(matchers, "prepare_timeout_s", 0.1)
    free = _params(None, max_tokens=8)
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match="not ready within 0.1 s") as e:
        engine.add_request([5, 6, 7], _params(Constraint.json_schema(LIST)), "slow")
    assert e.value.param == "structured"
    engine.add_request([5, 6, 8], free, "free")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(done) == {"free"} and done["free"].outputs[0].finish_reason == "length"
    kv = engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_blocks


def test_a_grammar_whose_masks_grow_past_the_budget_fails_alone(llm):
    """An ambiguous grammar's parse grows with the reply (here a mask costs ~1 ms by 40
    tokens and ~300 ms by 200); past the budget the reply ends in error, and the request
    beside it writes what it writes alone."""
    engine, tok = llm.engine, llm.tokenizer
    with_b = {t: -100 for t in range(tok.vocab_size) if "b" in tok.decode([t])}  # only a's
    ambiguous = Constraint("grammar", 'start: x "b"\nx: "a" | x x | x x x | x x x x')
    free = _params(None, max_tokens=40, ignore_eos=True)
    alone = llm.generate(["The capital of France is"], free, use_tqdm=False)[0].outputs[0].text
    engine.add_request("Write a's:", _params(ambiguous, max_tokens=400, logit_bias=with_b), "slow")
    engine.add_request("The capital of France is", free, "free")
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert "mask took" in done["slow"].error
    assert done["slow"].error_param == "structured"  # the request's own error, not the engine's
    assert set(done["slow"].outputs[0].text) == {"a"}
    assert done["free"].outputs[0].text == alone
    assert engine.core.structured.num_over_budget >= 1


def test_offline_chat_offers_tools_and_holds_the_reply_to_a_call(llm):
    from quill.frontend.tools import ToolChoice
    from quill.server.tools import ReplyReader

    tools = [{"type": "function", "function": {"name": "describe", "parameters": PERSON}}]
    ask = [{"role": "user", "content": "Describe Ada Lovelace."}]
    named = {"type": "function", "function": {"name": "describe"}}
    outs = llm.chat([ask, ask], _params(None), use_tqdm=False, tools=tools, tool_choice=named)
    for out in outs:
        message = ReplyReader(ToolChoice("named", "describe")).message(out.outputs[0].text)
        call = message["tool_calls"][0]["function"]
        assert call["name"] == "describe"
        jsonschema.validate(json.loads(call["arguments"]), PERSON)
    with pytest.raises(InvalidRequestError, match="tool_choice"):
        llm.chat(ask, _params(None), tools=tools, tool_choice={"type": "function",
                 "function": {"name": "other"}})  # fmt: skip


def test_a_grammar_whose_first_masks_are_over_the_budget_is_refused_up_front(llm, monkeypatch):
    """The masks are timed before the request is admitted: over the budget there, the
    request is refused at once (a 400), never queued."""
    matchers = llm.engine.core.structured
    monkeypatch.setattr(matchers, "mask_budget_s", 1e-9)
    with pytest.raises(InvalidRequestError, match="mask took .* at token 0") as e:
        llm.engine.add_request([5, 6, 7], _params(Constraint.json_schema(LIST)), "too-slow")
    assert e.value.param == "structured"
    assert not llm.engine.has_unfinished_requests()


def test_grammars_that_overflowed_a_thread_stack_compile_on_the_grammar_threads(llm):
    """5,000 chained $refs and 5,000 chained Lark rules recursed past the 8 MiB stack of an
    ordinary thread and ended the process; the grammar threads' stacks hold them (the server
    bounds what clients send far below: quill/frontend/json_limits.py)."""
    defs = {f"d{i}": {"$ref": f"#/$defs/d{i + 1}"} for i in range(5000)}
    defs["d5000"] = {"type": "string", "maxLength": 3}
    chain = "start: r0\n" + "\n".join(f"r{i}: r{i + 1}" for i in range(5000)) + '\nr5000: "a"'
    params = [
        _params(Constraint.json_schema({"$ref": "#/$defs/d0", "$defs": defs}), max_tokens=8),
        _params(Constraint("grammar", chain), max_tokens=8),
    ]
    outs = llm.generate(["Say a word:", "Say a:"], params, use_tqdm=False)
    assert isinstance(json.loads(outs[0].outputs[0].text), str)
    assert outs[1].outputs[0].text == "a"


def test_a_keyword_the_grammar_cannot_enforce_is_ignored_with_a_warning(llm, caplog):
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3}
    out = llm.generate(["Numbers:"], _params(Constraint.json_schema(schema)), use_tqdm=False)
    jsonschema.validate(json.loads(out[0].outputs[0].text), {**schema, "uniqueItems": False})
    assert "uniqueItems" in caplog.text


def test_a_matcher_that_fails_mid_reply_ends_it_as_the_requests_own_error(grammars):
    """A parser limit passed inside a mask: the mask allows only the end, and the reply ends
    with the grammar's error (the request's, not the engine's)."""
    from quill.structured.grammar import GrammarError
    from quill.structured.matchers import Prepared, ReplyMatchers

    class Failing:
        def bitmask(self):
            raise GrammarError("step_max_items exceeded")

    matchers = ReplyMatchers(grammars)
    matchers.attach("r", Prepared(Failing()))
    mask = matchers.bitmask("r")
    assert [t for t in range(49152) if mask[t // 8] >> (t % 8) & 1] == [2]  # <|im_end|> only
    assert "step_max_items exceeded" in matchers.take("r", [2])
    matchers.close()
