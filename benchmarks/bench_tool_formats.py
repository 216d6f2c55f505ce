"""Tool calls and reasoning in each model's own format (issue 45): validity, and what the
reasoning parser costs.

1. Calls (`--requests`, 60 per family): the issue-21 benchmark's drawn functions
   (benchmarks/bench_structured.py: 1-3 functions with drawn object parameters), tool_choice
   auto / required / named in turn, through the same path as `quill serve` (the family's
   template renders the tools, `required` and named calls are constrained to the family's
   format, the reply read by quill/server/tools.py). Families: Qwen3 (hermes, with thinking
   capped by a budget), Llama 3.1 (llama3_json), Mistral (mistral: the JSON array, and the
   newer `name[ARGS]{...}` form of the v11 templates), each a random-weight model
   of Qwen3-0.6B's layer shape with the family's tokenizer and template (tests/chat_fixtures.py:
   no real one installs from the registries). Counted: required / named replies whose calls
   parse and validate (`jsonschema`, the named function when named); auto replies whose
   `content` holds call markup or call JSON (must be none); replies whose stream (random
   chunks) joins to other than the whole message (must be none).
2. Parser cost: `quill serve` twice on one model (a random-weight model of SmolLM2-135M's
   shape with the DeepSeek-R1 template, whose prompt opens the thinking: every token of a
   reply is reasoning and goes through the parser), `--reasoning-parser none` and
   `deepseek_r1`, 16 streaming chat clients, the sides alternating for `--rounds`; output
   tokens/s of each, best round kept.

Usage:

    .venv/bin/python benchmarks/bench_tool_formats.py [--requests 60] [--rounds 3]
        [--json docs/results/bench_tool_formats.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.bench_server import _Connection, start_server  # noqa: E402
from benchmarks.bench_structured import WORDS, obj  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.frontend.tool_formats import detect_tool_format  # noqa: E402
from quill.frontend.tools import Function, ToolChoice  # noqa: E402
from quill.server.tools import ReplyReader  # noqa: E402
from tests.chat_fixtures import family_model  # noqa: E402

# Qwen3-0.6B's layers (its 151,936-token vocabulary replaced by the fixture tokenizer's).
QWEN3_06B = dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                 num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                 max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                    num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                    max_position_embeddings=4096, tie_word_embeddings=True)  # fmt: skip
FAMILIES = [("qwen3", "qwen3"), ("llama3.1", "llama3"), ("mistral", "mistral"),
            ("mistral_v11", "mistral")]  # fmt: skip
ASKS = ["What is the weather in Paris?", "Add 3 and 4.", "Book a table for two.",
        "Find flights to Rome.", "Tell me a joke."]  # fmt: skip
# Call JSON left in a text answer, or the family's own call markup: what leaks look like in
# the trackers. (The fixture tokenizers share one vocabulary, so a random model may write
# another family's marker as a word: that is text in this family.)
CALL_JSON = r'"name"\s*:\s*"[^"]*"\s*,\s*"(arguments|parameters)"'


def leak_pattern(fmt) -> re.Pattern:
    markers = [re.escape(m) for m in (fmt.open, fmt.close) if m]
    return re.compile("|".join([*markers, CALL_JSON]))


def calls_in_format(llm: LLM, rng: random.Random, requests: int, max_tokens: int) -> dict:
    cases = [(functions, choice, llm.chat_turn(ask, functions, choice))
             for functions, choice, ask in draw_cases(rng, requests)]  # fmt: skip
    budget = 32
    params = [turn.sampling_params(SamplingParams(max_tokens=max_tokens, temperature=0.8,
                                                  seed=i),
                                   budget if turn.reasoning is not None else None)
              for i, (_, _, turn) in enumerate(cases)]  # fmt: skip
    started = time.perf_counter()
    outs = llm.generate([t.prompt_ids for _, _, t in cases], params, use_tqdm=False)
    seconds = time.perf_counter() - started
    counts = {"required_or_named": 0, "valid": 0, "auto": 0, "auto_calls": 0,
              "auto_leaks": 0, "stream_mismatches": 0, "did_not_stop": 0}  # fmt: skip
    problems = []
    for i, ((functions, choice, turn), out) in enumerate(zip(cases, outs)):
        o = out.outputs[0]
        message = _reader(turn).message(o.text)
        if not _stream_matches(turn, o.text, message, rng):
            counts["stream_mismatches"] += 1
        if choice.mode == "auto":
            counts["auto"] += 1
            counts["auto_calls"] += bool(message.get("tool_calls"))
            leak = leak_pattern(turn.tools).search(message["content"] or "")
            if leak:
                counts["auto_leaks"] += 1
                around = message["content"][max(0, leak.start() - 80) : leak.end() + 120]
                problems.append({"request": i, "why": "call markup in content",
                                 "content": around, "text": o.text[-400:]})  # fmt: skip
            continue
        counts["required_or_named"] += 1
        schemas = {f.name: f.arguments_schema for f in functions}
        try:
            assert o.finish_reason == "stop", f"finish_reason {o.finish_reason}"
            assert message.get("tool_calls"), "no call"
            for call in message["tool_calls"]:
                fn = call["function"]
                assert choice.mode != "named" or fn["name"] == choice.name, "wrong function"
                jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
            counts["valid"] += 1
        except (AssertionError, KeyError, ValueError, jsonschema.ValidationError) as e:
            counts["did_not_stop"] += o.finish_reason != "stop"
            problems.append({"request": i, "why": str(e)[:200], "text": o.text[-200:]})
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    return {**counts, "tool_format": cases[0][2].tools.name,
            "reasoning": cases[0][2].reasoning.name if cases[0][2].reasoning else None,
            "thinking_budget": budget, "generated_tokens": generated, "seconds": seconds,
            "problems": problems}  # fmt: skip


def draw_cases(rng: random.Random, requests: int) -> list[tuple[list[Function], ToolChoice, list]]:
    """The issue-21 benchmark's functions and asks, tool_choice auto / required / named."""
    cases = []
    for i in range(requests):
        functions = [Function(f"{rng.choice(WORDS)}_{k}", "Does one thing", obj(rng, 2))
                     for k in range(rng.randint(1, 3))]  # fmt: skip
        mode = ("auto", "required", "named")[i % 3]
        choice = ToolChoice(mode, functions[-1].name if mode == "named" else None)
        cases.append((functions, choice, [{"role": "user", "content": rng.choice(ASKS)}]))
    return cases


def served_calls(model: Path, rng: random.Random, requests: int, max_tokens: int) -> dict:
    """The same requests through `quill serve` and the official `openai` client, 16 at a
    time, every other one streamed (its deltas joined as a client joins them)."""
    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    fmt = detect_tool_format(template)
    cases = draw_cases(rng, requests)
    proc, url = start_server("shared", [str(model)])
    try:
        results = asyncio.run(_served(url, cases, max_tokens, "enable_thinking" in template))
    finally:
        proc.terminate()
        proc.wait(30)
    counts = {"required_or_named": 0, "valid": 0, "auto": 0, "auto_calls": 0,
              "auto_leaks": 0, "streamed": requests // 2}  # fmt: skip
    problems = []
    for i, ((functions, choice, _), (content, calls, finish)) in enumerate(zip(cases, results)):
        if choice.mode == "auto":
            counts["auto"] += 1
            counts["auto_calls"] += bool(calls)
            if leak_pattern(fmt).search(content):
                counts["auto_leaks"] += 1
                problems.append({"request": i, "why": "call markup in content", "content": content})
            continue
        counts["required_or_named"] += 1
        schemas = {f.name: f.arguments_schema for f in functions}
        try:
            assert finish == ("stop" if choice.mode == "named" else "tool_calls"), finish
            assert calls, "no call"
            for name, arguments in calls:
                assert choice.mode != "named" or name == choice.name, "wrong function"
                jsonschema.validate(json.loads(arguments), schemas[name])
            counts["valid"] += 1
        except (AssertionError, KeyError, ValueError, jsonschema.ValidationError) as e:
            problems.append({"request": i, "why": str(e)[:200], "calls": calls})
    return {**counts, "tool_format": fmt.name, "problems": problems}


async def _served(url: str, cases, max_tokens: int, thinks: bool) -> list:
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0,
                                timeout=600)  # fmt: skip
    gate = asyncio.Semaphore(16)

    async def one(i: int, functions, choice, ask) -> tuple[str, list, str]:
        tools = [{"type": "function", "function": f.offered()} for f in functions]
        tool_choice = choice.mode if choice.mode != "named" else \
            {"type": "function", "function": {"name": choice.name}}  # fmt: skip
        kwargs = dict(model=None, messages=ask, tools=tools, tool_choice=tool_choice,
                      temperature=0.8, seed=i, max_tokens=max_tokens,
                      extra_body={"thinking_token_budget": 32} if thinks else None)  # fmt: skip
        async with gate:
            if i % 2 == 0:
                r = await client.chat.completions.create(**kwargs)
                m = r.choices[0].message
                calls = [(c.function.name, c.function.arguments) for c in m.tool_calls or []]
                return m.content or "", calls, r.choices[0].finish_reason
            content, joined, finish = "", {}, None
            async for chunk in await client.chat.completions.create(stream=True, **kwargs):
                if not chunk.choices:
                    continue
                delta = chunk.choices[0].delta
                content += delta.content or ""
                for c in delta.tool_calls or []:
                    entry = joined.setdefault(c.index, ["", ""])
                    entry[0] += (c.function.name or "") if c.id else ""
                    entry[1] += c.function.arguments or ""
                finish = chunk.choices[0].finish_reason or finish
            return content, [tuple(joined[k]) for k in sorted(joined)], finish

    try:
        return await asyncio.gather(*(one(i, *case) for i, case in enumerate(cases)))
    finally:
        await client.close()


def _reader(turn) -> ReplyReader:
    return ReplyReader(turn.choice, turn.tools, turn.reasoning, turn.opened)


def _stream_matches(turn, text: str, message: dict, rng: random.Random) -> bool:
    cuts = sorted({0, len(text), *(rng.randrange(len(text) + 1) for _ in range(12))})
    reader = _reader(turn)
    pieces = [text[a:b] for a, b in zip(cuts, cuts[1:])]
    content, reasoning, calls = "", "", {}
    for k, piece in enumerate(pieces):
        delta = reader.delta(piece, finished=k == len(pieces) - 1)
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for c in delta.get("tool_calls", []):
            entry = calls.setdefault(c["index"], ["", ""])
            entry[0] += c.get("function", {}).get("name", "") if "id" in c else ""
            entry[1] += c.get("function", {}).get("arguments", "")
    whole_calls = [[c["function"]["name"], c["function"]["arguments"]]
                   for c in message.get("tool_calls", [])]  # fmt: skip
    return (content == (message["content"] or "")
            and reasoning == (message.get("reasoning_content") or "")
            and [calls[i] for i in sorted(calls)] == whole_calls)  # fmt: skip


# -- the parser's cost ---------------------------------------------------------------------


async def _chat_clients(url: str, clients: int, requests: int, max_tokens: int) -> dict:
    async def client(k: int) -> int:
        conn = _Connection(url)
        tokens = 0
        try:
            for r in range(requests):
                words = " ".join(random.Random(k * 1000 + r).choices(WORDS, k=32))
                body = {"messages": [{"role": "user", "content": words}],
                        "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                        "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
                _, last = await conn.stream(body, b"/v1/chat/completions", b'"delta"')
                tokens += last["usage"]["completion_tokens"]
        finally:
            conn.close()
        return tokens

    started = time.perf_counter()
    tokens = sum(await asyncio.gather(*(client(k) for k in range(clients))))
    seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds}


def parser_cost(model: Path, rounds: int, clients: int, max_tokens: int) -> dict:
    sides = {}
    for name in ("none", "deepseek_r1"):
        sides[name] = start_server("shared", [str(model), "--reasoning-parser", name])
    runs: dict[str, list] = {name: [] for name in sides}
    try:
        for _, url in sides.values():  # warm-up: compiles, first steps
            asyncio.run(_chat_clients(url, clients, 1, 8))
        for r in range(rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                run = asyncio.run(_chat_clients(sides[name][1], clients, 2, max_tokens))
                runs[name].append(run)
                print(f"round {r} {name}: {run['tokens_per_s']:.1f} tok/s", flush=True)
    finally:
        for proc, _ in sides.values():
            proc.terminate()
            proc.wait(30)
    best = {name: max(r["tokens_per_s"] for r in runs[name]) for name in runs}
    return {"clients": clients, "max_tokens": max_tokens, "runs": runs, "best": best,
            "ratio_parser_on": best["deepseek_r1"] / best["none"]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--families", default=",".join(f for f, _ in FAMILIES))
    parser.add_argument("--skip-calls", action="store_true")
    parser.add_argument("--skip-served", action="store_true")
    parser.add_argument("--skip-cost", action="store_true")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    result = {"machine": machine_info(2), "date": time.strftime("%Y-%m-%d"),
              "command": " ".join(sys.argv), "calls": {}}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_calls:
            for family, kind in FAMILIES:
                if family not in args.families.split(","):
                    continue
                model = family_model(Path(tmp) / family, family, kind, **QWEN3_06B)
                llm = LLM(str(model))
                rng = random.Random(args.seed)
                result["calls"][family] = calls_in_format(llm, rng, args.requests,
                                                          args.max_tokens)  # fmt: skip
                print(family, json.dumps({k: v for k, v in result["calls"][family].items()
                                          if k != "problems"}), flush=True)  # fmt: skip
                del llm
                if not args.skip_served:
                    served = served_calls(model, random.Random(args.seed), args.requests,
                                          args.max_tokens)  # fmt: skip
                    result.setdefault("served", {})[family] = served
                    brief = {k: v for k, v in served.items() if k != "problems"}
                    print(family, "served", json.dumps(brief), flush=True)
        if not args.skip_cost:
            model = family_model(Path(tmp) / "r1", "deepseek_r1", "llama", **SMOLLM2_135M)
            result["parser_cost"] = parser_cost(model, args.rounds, args.clients, 128)
            print(json.dumps(result["parser_cost"]["best"]),
                  f"ratio {result['parser_cost']['ratio_parser_on']:.3f}")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
