"""A model in its own words, served: a random-weight Qwen3-shaped model with the Qwen3 family's
tokenizer and template (tests/chat_fixtures.py) behind `quill serve`, driven by the official
clients unmodified: tool calls in the hermes format (streamed equal to whole), the thinking in
`reasoning_content` / `reasoning`, `chat_template_kwargs`, the thinking budget, code infill
(`suffix`, `/infill`), and the OpenAI Agents SDK running an agent with a function tool to
completion.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated

import httpx
import jsonschema
import openai
import pytest
from pydantic import Field
from server_helpers import API_KEY

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
           "required": ["city"], "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def _joined(chunks) -> dict:
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in chunks:
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        extra = delta.model_extra or {}
        assert extra.get("reasoning_content") == extra.get("reasoning")
        reasoning += extra.get("reasoning_content") or ""
        for call in delta.tool_calls or []:
            entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
            if call.function and call.function.name:
                assert entry["name"] is None  # the name once
                entry["name"] = call.function.name
            if call.function and call.function.arguments:
                entry["arguments"] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    return {"content": content, "reasoning": reasoning, "finish": finish,
            "calls": [calls[i] for i in sorted(calls)]}  # fmt: skip


def _whole(response) -> dict:
    message = response.choices[0].message
    extra = message.model_extra or {}
    assert extra.get("reasoning_content") == extra.get("reasoning")
    calls = [{"name": c.function.name, "arguments": c.function.arguments}
             for c in message.tool_calls or []]  # fmt: skip
    return {"content": message.content or "", "reasoning": extra.get("reasoning_content") or "",
            "finish": response.choices[0].finish_reason, "calls": calls}  # fmt: skip


def test_required_calls_come_in_the_model_format_streamed_as_whole(qwen3, qwen3_server):
    assert qwen3_server.ctx.chat_format.tools.name == "hermes"
    for seed in range(3):
        kwargs = dict(model=qwen3_server.ctx.model_name, messages=ASK, tools=TOOLS,
                      tool_choice="required", temperature=1.0, seed=seed, max_tokens=120,
                      extra_body={"thinking_token_budget": 6})  # fmt: skip
        whole = _whole(qwen3.chat.completions.create(**kwargs))
        stream = _joined(qwen3.chat.completions.create(stream=True, **kwargs))
        assert stream == whole
        assert whole["finish"] == "tool_calls" and len(whole["calls"]) == 1
        assert whole["calls"][0]["name"] == "get_weather"
        jsonschema.validate(json.loads(whole["calls"][0]["arguments"]), WEATHER)
        assert "<tool_call>" not in whole["content"] and "</think>" not in whole["content"]


def test_auto_never_leaves_call_markup_in_content(qwen3, qwen3_server):
    for seed in range(3):
        response = qwen3.chat.completions.create(
            model=qwen3_server.ctx.model_name, messages=ASK, tools=TOOLS, tool_choice="auto",
            temperature=1.0, seed=seed, max_tokens=24, extra_body=NO_THINKING,
        )  # fmt: skip
        content = response.choices[0].message.content or ""
        assert "<tool_call>" not in content and "</tool_call>" not in content


def test_thinking_goes_to_reasoning_content_and_the_budget_closes_it(qwen3, qwen3_tok):
    think, end = qwen3_tok.encode("<think>", False)[0], qwen3_tok.encode("</think>", False)[0]
    # The reply opens its block at once and never closes it by itself: the budget must.
    kwargs = dict(messages=ASK, temperature=1.0, seed=3, max_tokens=10,
                  logit_bias={str(think): 100, str(end): -100},
                  extra_body={"thinking_token_budget": 4})  # fmt: skip
    whole = _whole(qwen3.chat.completions.create(model=None, **kwargs))
    stream = _joined(qwen3.chat.completions.create(model=None, stream=True, **kwargs))
    assert stream == whole
    assert whole["reasoning"] and "</think>" not in whole["reasoning"] + whole["content"]
    response = qwen3.chat.completions.create(model=None, **kwargs)
    assert response.usage.completion_tokens == 10
    # Thinking off through the template: nothing to split, the prompt says so.
    on = qwen3.chat.completions.create(model=None, messages=ASK, max_tokens=1)
    off = qwen3.chat.completions.create(model=None, messages=ASK, max_tokens=1,
                                        extra_body=NO_THINKING)  # fmt: skip
    closed = qwen3_tok.encode("<think>\n\n</think>\n\n", False)
    assert off.usage.prompt_tokens == on.usage.prompt_tokens + len(closed)
    assert (off.choices[0].message.model_extra or {}).get("reasoning_content") is None


def test_include_reasoning_false_drops_the_thinking(qwen3, qwen3_tok):
    think = qwen3_tok.encode("<think>", False)[0]
    response = qwen3.chat.completions.create(
        model=None, messages=ASK, temperature=1.0, seed=1, max_tokens=8,
        logit_bias={str(think): 100}, extra_body={"include_reasoning": False},
    )  # fmt: skip
    message = response.choices[0].message
    assert "reasoning_content" not in (message.model_extra or {})
    assert "<think>" not in (message.content or "")


def test_suffix_and_infill_lay_the_prompt_out_in_fim_order(qwen3_server, qwen3, qwen3_tok):
    def ids(name: str) -> list[int]:
        return [qwen3_tok.backend.token_to_id(name)]

    def text(value: str) -> list[int]:
        return qwen3_tok.encode(value, False)

    prefix, suffix = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    expected = (ids("<|fim_prefix|>") + text(prefix) + ids("<|fim_suffix|>") + text(suffix)
                + ids("<|fim_middle|>"))  # fmt: skip
    response = qwen3.completions.create(model=None, prompt=prefix, suffix=suffix, max_tokens=4,
                                        temperature=0)  # fmt: skip
    assert response.usage.prompt_tokens == len(expected)
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4, "temperature": 0,
            "input_extra": [{"filename": "util.py", "text": "X = 1\n"}]}  # fmt: skip
    with httpx.Client(base_url=qwen3_server.base_url, headers=headers, timeout=60) as http:
        r = http.post("/infill", json=body)
        assert r.status_code == 200, r.text
        reply = r.json()
        extra = ids("<|file_sep|>") + text("util.py\nX = 1\n") + ids("<|file_sep|>")
        assert reply["tokens_evaluated"] == len(extra + expected)
        assert reply["stop"] is True and reply["tokens_predicted"] == 4
        assert reply["stop_type"] == "limit"
        with http.stream("POST", "/infill", json={**body, "stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
        assert "".join(e["content"] for e in events) == reply["content"]
        assert events[-1]["stop"] is True
        bad = http.post("/v1/completions", json={"prompt": [1, 2], "suffix": "x"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "suffix"


def test_a_model_without_fim_tokens_refuses_infill(client, http):
    with pytest.raises(openai.BadRequestError, match="fill-in-the-middle"):
        client.completions.create(model=None, prompt="def f(", suffix="):", max_tokens=2)
    r = http.post("/infill", json={"input_prefix": "a", "input_suffix": "b"})
    assert r.status_code == 400 and "fill-in-the-middle" in r.json()["error"]["message"]


def test_the_agents_sdk_runs_an_agent_with_a_function_tool_to_completion(qwen3_server):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=10)]) -> str:
        """The weather now in a city."""
        seen.append(city)
        return f"18 C in {city}"

    client = openai.AsyncOpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key=API_KEY,
                                max_retries=0)  # fmt: skip
    agent = Agent(
        name="weather",
        instructions="Answer with the weather tool.",
        tools=[get_weather],
        model=OpenAIChatCompletionsModel(model=qwen3_server.ctx.model_name, openai_client=client),
        model_settings=ModelSettings(
            tool_choice="required", max_tokens=60, temperature=1.0, extra_body=NO_THINKING
        ),  # fmt: skip
        tool_use_behavior="stop_on_first_tool",
    )
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=3))
    assert len(seen) == 1 and isinstance(seen[0], str)
    assert result.final_output == f"18 C in {seen[0]}"
