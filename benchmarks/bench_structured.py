"""Structured output against the default model: seeded JSON schemas of varied shapes, every
reply checked by `jsonschema`; then what the masks cost the steps they are in.

1. Validity: `--schemas` (100) schemas drawn from a seed (objects with required and optional
   properties, arrays with bounds, enums, nested `$ref` to `$defs`, `anyOf`, string formats and
   patterns, numeric bounds), one chat request each asking for JSON of that schema, all in one
   batch, greedy. Counted: replies that parse and validate, replies that did not stop (cut by
   max_tokens), the grammar compile and mask times.
2. Tool calls: `--tool-requests` (60) chat requests offering drawn functions, tool_choice
   auto / required / named in turn; every call's arguments validated against its function.
3. Cost: 16 constrained streams beside 16 free ones against the same 32 with no constraint
   (alternating, `--rounds`): the free ones' tokens/s and the constrained ones' tokens/s.

Usage:

    .venv/bin/python benchmarks/bench_structured.py [--schemas 100] [--seed 0] [--rounds 2]
        [--json docs/results/bench_structured_issue21.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

import jsonschema

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402
from quill.contract.constraint import Constraint  # noqa: E402
from quill.frontend.tools import (  # noqa: E402
    Function,
    ToolChoice,
    render_conversation,
    reply_constraint,
)
from quill.server.tools import ReplyReader  # noqa: E402

WORDS = ["name", "city", "age", "price", "tags", "owner", "items", "kind", "score", "when", "id"]


def leaf(rng: random.Random) -> dict:
    kind = rng.choice(["int", "num", "str", "enum", "bool", "date", "pattern", "email"])
    if kind == "int":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(1, 1000)}
    if kind == "num":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 10, 100])}
    if kind == "str":
        return {"type": "string", "minLength": 1, "maxLength": rng.randint(3, 16)}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "small", "large", 1, 2, None], 3)}
    if kind == "bool":
        return {"type": "boolean"}
    if kind == "date":
        return {"type": "string", "format": "date"}
    if kind == "email":
        return {"type": "string", "format": "email", "maxLength": 30}
    return {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"}


def node(rng: random.Random, depth: int) -> dict:
    if depth <= 0:
        return leaf(rng)
    kind = rng.choice(["object", "object", "array", "anyOf", "leaf"])
    if kind == "leaf":
        return leaf(rng)
    if kind == "array":
        return {"type": "array", "items": node(rng, depth - 1), "minItems": 1,
                "maxItems": rng.randint(1, 4)}  # fmt: skip
    if kind == "anyOf":
        return {"anyOf": [node(rng, depth - 1), leaf(rng)]}
    return obj(rng, depth)


def obj(rng: random.Random, depth: int) -> dict:
    names = rng.sample(WORDS, rng.randint(1, 4))
    props = {n: node(rng, depth - 1) for n in names}
    required = [n for n in names if rng.random() < 0.8] or names[:1]
    return {"type": "object", "properties": props, "required": required,
            "additionalProperties": False}  # fmt: skip


def schema(rng: random.Random) -> dict:
    if rng.random() < 0.25:  # a shared definition, referenced twice
        shared = node(rng, 1)
        return {"$defs": {"part": shared}, "type": "object",
                "properties": {"first": {"$ref": "#/$defs/part"},
                               "second": {"$ref": "#/$defs/part"}},
                "required": ["first", "second"], "additionalProperties": False}  # fmt: skip
    return node(rng, rng.randint(1, 3))


def validity(llm: LLM, schemas: list[dict], max_tokens: int) -> dict:
    chats = [[{"role": "user", "content": "Reply with JSON matching this schema: "
               + json.dumps(s)}] for s in schemas]  # fmt: skip
    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             structured=Constraint.json_schema(s)) for s in schemas]  # fmt: skip
    matchers = llm.engine.core.structured
    before = (matchers.num_compiled, matchers.compile_seconds, matchers.num_masks,
              matchers.mask_seconds)  # fmt: skip
    started = time.perf_counter()
    outs = llm.chat(chats, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    valid, unstopped, problems = 0, 0, []
    checker = jsonschema.FormatChecker()
    for i, (s, out) in enumerate(zip(schemas, outs)):
        o = out.outputs[0]
        if o.finish_reason != "stop":
            unstopped += 1
            problems.append({"schema": i, "why": f"finish_reason {o.finish_reason}",
                             "text": o.text[-120:]})  # fmt: skip
            continue
        try:
            jsonschema.validate(json.loads(o.text), s, format_checker=checker)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            problems.append({"schema": i, "why": str(e)[:200], "text": o.text[:200]})
    compiled = matchers.num_compiled - before[0]
    masks = matchers.num_masks - before[2]
    return {
        "schemas": len(schemas),
        "valid": valid,
        "did_not_stop": unstopped,
        "problems": problems,
        "seconds": seconds,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "compile_ms_mean": (matchers.compile_seconds - before[1]) / compiled * 1e3,
        "mask_us_mean": (matchers.mask_seconds - before[3]) / masks * 1e6 if masks else None,
        "masks": masks,
    }


def tool_calls(llm: LLM, rng: random.Random, requests: int, max_tokens: int) -> dict:
    """Chat requests offering 1-3 functions with drawn object parameters, tool_choice cycling
    through auto, required and a named function, through the server's own path (the prompt
    written by quill/frontend/tools.py, the reply read back by quill/server/tools.py); every
    call's arguments checked by `jsonschema` against its function's parameters."""
    asks = ["What is the weather in Paris?", "Add 3 and 4.", "Book a table for two.",
            "Find flights to Rome.", "Tell me a joke."]  # fmt: skip
    cases = []
    for i in range(requests):
        functions = [Function(f"{rng.choice(WORDS)}_{k}", "Does one thing",
                              obj(rng, 2) if rng.random() < 0.9 else None)
                     for k in range(rng.randint(1, 3))]  # fmt: skip
        mode = ("auto", "required", "named")[i % 3]
        choice = ToolChoice(mode, functions[-1].name if mode == "named" else None)
        messages = render_conversation([{"role": "user", "content": rng.choice(asks)}],
                                       functions, choice)  # fmt: skip
        cases.append((functions, choice, messages))
    params = [SamplingParams(max_tokens=max_tokens, temperature=0,
                             structured=reply_constraint(f, c)) for f, c, _ in cases]  # fmt: skip
    outs = llm.chat([m for _, _, m in cases], params, use_tqdm=False)
    valid, unstopped, calls, answers, long_answers, problems = 0, 0, 0, 0, 0, []
    for i, ((functions, choice, _), out) in enumerate(zip(cases, outs)):
        o = out.outputs[0]
        message = ReplyReader(choice).message(o.text)
        if o.finish_reason != "stop":
            if not message.get("tool_calls") and o.text.startswith('{"response":'):
                long_answers += 1  # a text answer longer than max_tokens, as without tools
                continue
            unstopped += 1
            problems.append({"request": i, "why": f"finish_reason {o.finish_reason}",
                             "text": o.text[-120:]})  # fmt: skip
            continue
        schemas = {f.name: f.arguments_schema for f in functions}
        try:
            if not message.get("tool_calls"):
                assert choice.mode == "auto" and isinstance(message["content"], str), "no call"
                answers += 1
            for call in message.get("tool_calls", []):
                fn = call["function"]
                assert choice.mode != "named" or fn["name"] == choice.name, "wrong function"
                jsonschema.validate(json.loads(fn["arguments"]), schemas[fn["name"]])
                calls += 1
            valid += 1
        except (AssertionError, KeyError, ValueError, jsonschema.ValidationError) as e:
            problems.append({"request": i, "why": str(e)[:200], "text": o.text[:200]})
    return {"requests": requests, "valid": valid, "did_not_stop": unstopped, "calls": calls,
            "text_answers": answers, "text_answers_cut_by_max_tokens": long_answers,
            "problems": problems}  # fmt: skip


def cost(llm: LLM, rounds: int, tokens: int) -> dict:
    """16 free + 16 constrained against 32 free, alternating; tokens/s of each group."""
    city = {"type": "object", "properties": {"name": {"type": "string"}, "facts": {"type": "array",
            "items": {"type": "string"}}}, "required": ["name", "facts"]}  # fmt: skip
    free = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    held = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True,
                          structured=Constraint.json_schema(city))  # fmt: skip
    sides = {"without": [free] * 32, "with": [free] * 16 + [held] * 16}
    results = {name: [] for name in sides}
    for k in range(rounds):
        for name in list(sides) if k % 2 == 0 else list(sides)[::-1]:
            engine = llm.engine
            for i, p in enumerate(sides[name]):
                engine.add_request(f"City number {i}, described as JSON:", p, f"{name}{k}-{i}")
            done: dict[str, float] = {}
            started = time.perf_counter()
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = time.perf_counter() - started
            groups = {"first16": [done[f"{name}{k}-{i}"] for i in range(16)],
                      "last16": [done[f"{name}{k}-{i}"] for i in range(16, 32)]}  # fmt: skip
            results[name].append({g: 16 * tokens / max(v) for g, v in groups.items()})
    best = {name: {g: max(r[g] for r in rs) for g in ("first16", "last16")}
            for name, rs in results.items()}  # fmt: skip
    return {
        "rounds": results,
        "best": best,
        "free_ratio": best["with"]["first16"] / best["without"]["first16"],
        "constrained_ratio": best["with"]["last16"] / best["without"]["last16"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemas", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--tool-requests", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cost-tokens", type=int, default=64)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    schemas = [schema(rng) for _ in range(args.schemas)]
    llm = LLM(quantization="none", dtype="float32", kv_cache_dtype="float32")
    result = {
        "machine": machine_info(2),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(sys.argv),
        "validity": validity(llm, schemas, args.max_tokens),
        "tool_calls": tool_calls(llm, rng, args.tool_requests, args.max_tokens),
        "cost": cost(llm, args.rounds, args.cost_tokens),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1)[:4000])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
