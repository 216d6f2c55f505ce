"""Each model in its own words: tools rendered by the family's template (checked token for token
against transformers' apply_chat_template), the tool-call and reasoning readers against scripted
replies cut at every position (the joined stream equals the whole reply, and both equal the
hand-written calls), chat_template_kwargs, constrained calls in each family's format generated
by random-weight models of its shape (every one parsing and validating under `jsonschema`),
and the thinking budget cutting at the stated count.

The families' tokenizers and templates are tests/chat_fixtures.py's (no real one installs
from the registries).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.contract.errors import InvalidRequestError
from quill.contract.sampling_params import SamplingParams
from quill.frontend.chat import ChatFormat, prepare_chat
from quill.frontend.reasoning import REASONING_FORMATS
from quill.frontend.tokenizer import Tokenizer
from quill.frontend.tool_formats import FORMATS, MISTRAL_NAMED_ARGS
from quill.frontend.tools import ToolChoice, read_tools
from quill.server.tools import ReplyReader
from tests.chat_fixtures import FAMILIES, family_model, family_tokenizer

# Strings bounded: a random-weight model writes a free string until max_tokens.
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
           "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"],
           "additionalProperties": False}  # fmt: skip
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
       "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather now",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "a + b",
                                      "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
CALL_ID = "a1b2c3d4e"  # nine characters: Mistral's template takes no other
# OpenAI's shape, as a client sends it: arguments as JSON text.
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": CALL_ID, "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18 C"},
    {"role": "user", "content": "And Rome?"},
]  # fmt: skip
# The same conversation as transformers documents it for apply_chat_template: arguments as
# an object.
REFERENCE = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": CALL_ID, "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "tool_call_id": CALL_ID, "content": "18 C"},
    {"role": "user", "content": "And Rome?"},
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: family_tokenizer(root / family, family) for family in FAMILIES}


@pytest.mark.parametrize(
    "family, fmt",
    [("qwen2.5", "hermes"), ("qwen3", "hermes"), ("llama3.1", "llama3_json"),
     ("mistral", "mistral"), ("mistral_v11", "mistral")],
)  # fmt: skip
def test_the_template_renders_tools_calls_and_results_as_transformers_does(tokenizers, family, fmt):
    from transformers import AutoTokenizer

    directory = tokenizers[family]
    tok = Tokenizer.load(directory)
    chat = ChatFormat.choose(tok.hf.chat_template)
    assert chat.tools.name == fmt
    functions, choice = read_tools(TOOLS, "auto", None)
    turn = prepare_chat(tok, chat, CONVERSATION, functions, choice)
    hf = AutoTokenizer.from_pretrained(str(directory))
    text = hf.apply_chat_template(REFERENCE, tools=TOOLS, add_generation_prompt=True,
                                  tokenize=False)  # fmt: skip
    assert turn.prompt_text == text
    assert turn.prompt_ids == hf(text, add_special_tokens=False)["input_ids"]
    assert "get_weather" in text and "18 C" in text and "Paris" in text
    # tool_choice "none": the tools are not offered, the history is still the template's.
    none_turn = prepare_chat(tok, chat, CONVERSATION, functions, None)
    assert none_turn.prompt_text == hf.apply_chat_template(
        REFERENCE, add_generation_prompt=True, tokenize=False
    )


def test_a_template_without_tools_keeps_the_generic_format(model_dir):
    tokenizer = Tokenizer.load(model_dir)
    chat = ChatFormat.choose(tokenizer.hf.chat_template)
    assert chat.tools.name == "generic" and chat.reasoning is None
    functions, choice = read_tools(TOOLS, "auto", None)
    turn = prepare_chat(tokenizer, chat, CONVERSATION, functions, choice)
    call = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}}]}'
    assert call in turn.prompt_text
    assert turn.constraint is not None and turn.constraint.kind == "json_schema"


# -- the readers -------------------------------------------------------------------------

# (format, reasoning format, prompt opened the thinking, reply text, expected message)
SCRIPTS = [
    ("hermes", None, False,
     'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
     '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": [2, {"c": "}<"}]}}'
     "\n</tool_call>",
     {"content": "Let me look.", "calls": [("get_weather", '{"city": "Paris"}'),
                                           ("add", '{"a": 1, "b": [2, {"c": "}<"}]}')]}),
    ("hermes", None, False, "a < b, and <tool is not a call; x <tool_cal",
     {"content": "a < b, and <tool is not a call; x <tool_cal", "calls": []}),
    ("hermes", "qwen3", False,
     "<think>\nThe user wants </thin weather.\n</think>\n\n<tool_call>\n"
     '{"name": "get_weather", "arguments": {"city": "Rome", "unit": "celsius"}}\n</tool_call>',
     {"reasoning": "The user wants </thin weather.\n", "content": None,
      "calls": [("get_weather", '{"city": "Rome", "unit": "celsius"}')]}),
    ("llama3_json", None, False,
     '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
     '{"name": "add", "parameters": {"a": 2, "b": 3.5}}',
     {"content": None, "calls": [("get_weather", '{"city": "Paris"}'),
                                 ("add", '{"a": 2, "b": 3.5}')]}),
    ("llama3_json", None, False, '  {"name": "add", "parameters": {"a": -1, "b": 0}}',
     {"content": None, "calls": [("add", '{"a": -1, "b": 0}')]}),
    ("llama3_json", None, False, "It is 18 C {in Paris}.",
     {"content": "It is 18 C {in Paris}.", "calls": []}),
    ("llama3_json", None, False,
     'Let me check. <|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
     {"content": "Let me check.", "calls": [("get_weather", '{"city": "Oslo"}')]}),
    ("llama3_json", None, False, "Odd <|python_tag|>words, not JSON",
     {"content": "Odd words, not JSON", "calls": []}),
    ("mistral", None, False,
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
     '{"name": "add", "arguments": {"a": 1, "b": 2}}]',
     {"content": None, "calls": [("get_weather", '{"city": "Paris"}'),
                                 ("add", '{"a": 1, "b": 2}')]}),
    ("mistral_args", None, False,
     'Checking. [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]add[ARGS]'
     '{"a": 1, "b": [2, "]"]}',
     {"content": "Checking.", "calls": [("get_weather", '{"city": "Paris"}'),
                                        ("add", '{"a": 1, "b": [2, "]"]}')]}),
    ("mistral_args", None, False, "A [TOOL_CALLS]half-written name",
     {"content": "A half-written name", "calls": []}),
    ("generic", None, False,
     '{"tool_calls":[{"name":"add","arguments":{"a":1,"b":2}}]}',
     {"content": None, "calls": [("add", '{"a":1,"b":2}')]}),
    (None, "deepseek_r1", True, "Okay, 2 + 2.\nThat is 4.</think>\n\nThe answer is **4**.",
     {"reasoning": "Okay, 2 + 2.\nThat is 4.", "content": "The answer is **4**."}),
    (None, "qwen3", False, "No thinking here: 4.",
     {"reasoning": None, "content": "No thinking here: 4."}),
    (None, "deepseek_r1", True, "Still thinking when max_tokens came </thi",
     {"reasoning": "Still thinking when max_tokens came </thi", "content": ""}),
]  # fmt: skip


def _reader(fmt, reasoning, opened):
    choice = None if fmt is None else ToolChoice("auto", parallel=True)
    tool_format = MISTRAL_NAMED_ARGS if fmt == "mistral_args" else FORMATS[fmt or "generic"]
    return ReplyReader(choice, tool_format, REASONING_FORMATS.get(reasoning), opened)


def _joined(deltas: list[dict]) -> dict:
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == "".join(d.get("reasoning", "") for d in deltas)
    calls: dict[int, list] = {}
    for d in deltas:
        for c in d.get("tool_calls", []):
            if "id" in c:
                assert c["index"] not in calls  # id and name once
                calls[c["index"]] = [c["function"]["name"], ""]
            calls[c["index"]][1] += c.get("function", {}).get("arguments", "")
    return {"content": content, "reasoning": reasoning,
            "calls": [tuple(calls[i]) for i in sorted(calls)]}  # fmt: skip


def _whole(message: dict) -> dict:
    return {
        "content": message["content"] or "",
        "reasoning": message.get("reasoning_content") or "",
        "calls": [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ],  # fmt: skip
    }


def _check_script(script, cuts):
    fmt, reasoning, opened, text, expected = script
    whole = _reader(fmt, reasoning, opened).message(text)
    got = _whole(whole)
    assert got["content"] == (expected["content"] or "")
    assert got["calls"] == expected.get("calls", [])
    assert got["reasoning"] == (expected.get("reasoning") or "")
    if reasoning is not None:
        assert whole["reasoning"] == whole["reasoning_content"]
    stream = _reader(fmt, reasoning, opened)
    points = sorted({0, len(text), *cuts})
    pieces = [text[a:b] for a, b in zip(points, points[1:])]
    deltas = [stream.delta(p, finished=i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert _joined(deltas) == got, (pieces, deltas)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda s: f"{s[0]}-{s[1]}")
def test_every_cut_of_a_scripted_reply_streams_what_the_whole_reply_says(script):
    text = script[3]
    for cut in range(len(text) + 1):
        _check_script(script, [cut])


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(SCRIPTS), st.lists(st.integers(0, 400), max_size=12))
def test_random_chunkings_stream_what_the_whole_reply_says(script, cuts):
    _check_script(script, [c % (len(script[3]) + 1) for c in cuts])


def test_mistral_calls_get_the_nine_character_ids_its_template_takes_back():
    text = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
    message = _reader("mistral", None, False).message(text)
    (call,) = message["tool_calls"]
    assert len(call["id"]) == 9 and call["id"].isalnum()
    assert (
        _reader("hermes", None, False)
        .message('<tool_call>\n{"name": "add", "arguments": {}}\n</tool_call>')["tool_calls"][0][
            "id"
        ]
        .startswith("call_")
    )


def test_a_call_whose_json_breaks_off_leaves_its_text_as_content():
    text = '<tool_call>\n{"nam: oops</tool_call> and more'
    message = _reader("hermes", None, False).message(text)
    assert "tool_calls" not in message
    assert message["content"] == text


# -- template arguments and reasoning ---------------------------------------------------


def test_chat_template_kwargs_change_the_prompt_as_the_template_says(tokenizers):
    tok = Tokenizer.load(tokenizers["qwen3"])
    chat = ChatFormat.choose(tok.hf.chat_template)
    assert chat.reasoning.name == "qwen3"
    ask = [{"role": "user", "content": "2 + 2?"}]
    on = prepare_chat(tok, chat, ask)
    off = prepare_chat(tok, chat, ask, template_kwargs={"enable_thinking": False})
    assert off.prompt_text == on.prompt_text + "<think>\n\n</think>\n\n"
    assert on.reasoning is not None and not on.opened
    assert off.reasoning is None  # the template closed the block: nothing to split
    # A server default, and a request overriding it.
    quiet = ChatFormat.choose(tok.hf.chat_template, template_kwargs={"enable_thinking": False})
    assert prepare_chat(tok, quiet, ask).prompt_text == off.prompt_text
    loud = prepare_chat(tok, quiet, ask, template_kwargs={"enable_thinking": True})
    assert loud.prompt_text == on.prompt_text
    # The call's own options are not the template's to set.
    for name in ("chat_template", "tokenize", "tools", "add_generation_prompt"):
        with pytest.raises(InvalidRequestError, match=name):
            prepare_chat(tok, chat, ask, template_kwargs={name: "x"})
    r1 = Tokenizer.load(tokenizers["deepseek_r1"])
    r1_turn = prepare_chat(r1, ChatFormat.choose(r1.hf.chat_template), ask)
    assert r1_turn.opened and r1_turn.prompt_text.endswith("<think>\n")


# -- random-weight models of each family's shape ------------------------------------------


@pytest.fixture(scope="module")
def family_llms(tmp_path_factory):
    from quill import LLM

    made = {}

    def get(family: str, kind: str):
        if family not in made:
            directory = family_model(tmp_path_factory.mktemp(family), family, kind)
            made[family] = LLM(str(directory), dtype="float32", quantization="none",
                               kv_cache_memory=64 << 20)  # fmt: skip
        return made[family]

    return get


def _check_calls(llm, family_tools, choice_field, parallel, n, seed, thinking_budget=None):
    functions, choice = read_tools(family_tools, choice_field, parallel)
    ask = [{"role": "user", "content": "What is the weather in Paris, and 2 + 3?"}]
    params = [SamplingParams(max_tokens=160, temperature=1.0, seed=seed + i) for i in range(n)]
    outs = llm.chat([ask] * n, params, use_tqdm=False, tools=family_tools,
                    tool_choice=choice_field, parallel_tool_calls=parallel,
                    thinking_budget=thinking_budget)  # fmt: skip
    turn = llm.chat_turn(ask, functions, choice)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        message = ReplyReader(turn.choice, turn.tools, turn.reasoning, turn.opened).message(o.text)
        calls = message.get("tool_calls")
        assert calls, o.text
        if not parallel:
            assert len(calls) == 1
        for call in calls:
            name = call["function"]["name"]
            if choice.mode == "named":
                assert name == choice.name
            jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[name])
        assert "tool_call" not in (message["content"] or "")
    return outs


@pytest.mark.parametrize(
    "family, kind",
    [("qwen3", "qwen3"), ("llama3.1", "llama3"), ("mistral", "mistral"),
     ("mistral_v11", "mistral")],
)  # fmt: skip
def test_constrained_calls_in_the_family_format_parse_and_validate(family_llms, family, kind):
    llm = family_llms(family, kind)
    named = {"type": "function", "function": {"name": "add"}}
    budget = 12 if family == "qwen3" else None  # its replies think first
    _check_calls(llm, TOOLS, "required", False, 4, 0, budget)
    _check_calls(llm, TOOLS, named, False, 3, 10, budget)
    if family != "llama3.1":  # its template takes one call a message
        _check_calls(llm, TOOLS, "required", True, 3, 20, budget)


def test_the_thinking_budget_forces_the_end_marker_at_the_stated_count(family_llms):
    llm = family_llms("qwen3", "qwen3")
    tok = llm.tokenizer
    start_id, end_id = tok.encode("<think>", False), tok.encode("</think>", False)
    assert len(start_id) == 1 and len(end_id) == 1
    ask = [{"role": "user", "content": "Think, then answer."}]
    # The model opens its block at once and never closes it by itself: the budget must.
    opening = {start_id[0]: 100.0, end_id[0]: -100.0}
    for budget in (0, 3, 9):
        params = SamplingParams(max_tokens=20, temperature=1.0, seed=budget, logit_bias=opening)
        ids = llm.chat(ask, params, use_tqdm=False, thinking_budget=budget)[0].outputs[0].token_ids
        cut = max(budget, 1)  # the opening marker is one of the budget's tokens
        assert ids[0] == start_id[0] and end_id[0] not in ids[:cut]
        assert ids[cut] == end_id[0], (budget, ids)
    # A reply that does not open the block is not cut.
    closed = {start_id[0]: -100.0, end_id[0]: -100.0}
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1, logit_bias=closed,
                            ignore_eos=True)  # fmt: skip
    ids = llm.chat(ask, params, use_tqdm=False, thinking_budget=2)[0].outputs[0].token_ids
    assert len(ids) == 12 and end_id[0] not in ids
    # Thinking turned off: the budget has nothing to cut.
    off = llm.chat(ask, params, use_tqdm=False, thinking_budget=2,
                   chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    assert len(off[0].outputs[0].token_ids) == 12


def test_structured_output_applies_after_the_thinking(family_llms):
    from quill.contract.constraint import Constraint

    llm = family_llms("qwen3", "qwen3")
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}  # fmt: skip
    ask = [{"role": "user", "content": "A number as JSON."}]
    rng = random.Random(0)
    constraint = Constraint.json_schema(schema)
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=rng.randrange(1 << 30),
                             structured=constraint) for _ in range(4)]  # fmt: skip
    outs = llm.chat([ask] * 4, params, use_tqdm=False, thinking_budget=8)
    turn = llm.chat_turn(ask)
    for out in outs:
        o = out.outputs[0]
        assert o.finish_reason == "stop", o.text
        message = ReplyReader(None, turn.tools, turn.reasoning, turn.opened).message(o.text)
        jsonschema.validate(json.loads(message["content"]), schema)
