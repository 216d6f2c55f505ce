"""Grammars from constraints (quill/structured): whatever path through a grammar's masks a
reply takes, it parses and validates. No model: a seeded random walk over the real tokenizer
picks any token each mask allows, and the decoded text is checked by the independent
references (`jsonschema`, Python's `re`)."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest

from quill.contract.constraint import Constraint
from quill.structured.grammar import GrammarError
from quill.structured.schema import MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS, bounded_numbers

END = 2  # SmolLM2-Instruct's <|im_end|>: the model's end id, not the tokenizer's <|endoftext|>

SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 500},
     "colour": {"enum": ["red", "green", "blue"]}}, "required": ["n", "colour"],
     "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"id": {"type": "integer",
     "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}, "required": ["id", "ok"],
     "additionalProperties": False}, "minItems": 1, "maxItems": 3},
    {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number", "minimum": 0,
     "maximum": 1}}, "required": ["x"], "additionalProperties": False}}, "type": "object",
     "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
     "required": ["a", "b"], "additionalProperties": False},
    {"anyOf": [{"type": "string", "maxLength": 6}, {"type": "integer", "minimum": 1,
     "maximum": 9}, {"type": "null"}]},
    {"type": "object", "properties": {"day": {"type": "string", "format": "date"}, "tag":
     {"type": "string", "pattern": "^[a-z]{2,4}$"}}, "required": ["day", "tag"],
     "additionalProperties": False},
]  # fmt: skip


def allowed(mask: bytes, vocab: int = 49152) -> list[int]:
    return [t for t in range(vocab) if mask[t // 8] >> (t % 8) & 1]


def closing_tokens(tokenizer) -> frozenset[int]:
    """Tokens that only close strings, arrays and objects: a walk that picks them often ends."""
    vocab = tokenizer.get_vocab_size()
    return frozenset(
        t for t in range(vocab) if (s := tokenizer.decode([t])) and set(s) <= set('}]"')
    )


def walk(grammars, constraint, rng, limit=400, closers=frozenset()) -> list[int]:
    """Tokens a random reply takes through the masks, up to and without its end token; one
    pick in two from `closers` where the mask allows one (so unbounded JSON ends)."""
    matcher = grammars.matcher(constraint)
    tokens = []
    for _ in range(limit):
        choices = allowed(matcher.bitmask())
        assert choices, "a mask allowed nothing"
        if END in choices and (len(choices) == 1 or rng.random() < 0.5):
            assert matcher.is_complete
            return tokens
        closing = [t for t in choices if t in closers] if rng.random() < 0.5 else []
        token = rng.choice(closing or [t for t in choices if t != END])
        matcher.accept(token)
        tokens.append(token)
        if matcher.is_finished:
            assert END in allowed(matcher.bitmask())
            return tokens
    raise AssertionError(f"no end after {limit} tokens")


@pytest.mark.parametrize("schema", SCHEMAS, ids=lambda s: next(iter(s)))
def test_every_walk_through_a_schema_validates(grammars, tokenizer, schema):
    rng = random.Random(0)
    for _ in range(6):
        text = tokenizer.decode(walk(grammars, Constraint.json_schema(schema), rng))
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())


def test_json_object_regex_choice_and_grammars(grammars, tokenizer):
    rng = random.Random(1)
    closers = closing_tokens(tokenizer)
    for _ in range(4):
        text = tokenizer.decode(walk(grammars, Constraint("json_object"), rng, closers=closers))
        assert isinstance(json.loads(text), dict)
        pattern = r"[a-z]{2,5}-[0-9]{3}"
        assert re.fullmatch(
            pattern, tokenizer.decode(walk(grammars, Constraint("regex", pattern), rng))
        )
        colours = ["red", "dark green", 'say "hi"']
        assert tokenizer.decode(walk(grammars, Constraint.choice(colours), rng)) in colours
        lark = 'start: "yes" | "no" NUM\nNUM: /[0-9]/'
        assert re.fullmatch(
            r"yes|no[0-9]", tokenizer.decode(walk(grammars, Constraint("grammar", lark), rng))
        )
        gbnf = 'root ::= "(" [a-c]+ ")"'
        assert re.fullmatch(
            r"\([a-c]+\)", tokenizer.decode(walk(grammars, Constraint("grammar", gbnf), rng))
        )


def test_bad_constraints_say_why_and_are_cached(grammars):
    for constraint, message in [
        (Constraint.json_schema({"type": "frobnicate"}), "frobnicate"),
        (Constraint("regex", "[a-"), "unclosed character class"),
        (Constraint("grammar", "start: missing_rule"), "missing_rule"),
        (Constraint.choice([]), "non-empty"),
    ]:
        with pytest.raises(GrammarError, match=message) as first:
            grammars.compile(constraint)
        with pytest.raises(GrammarError) as again:
            grammars.compile(constraint)
        assert again.value is first.value  # the failure was cached, not compiled twice
    good = Constraint.json_schema(SCHEMAS[0])
    assert grammars.compile(good) is grammars.compile(Constraint.json_schema(SCHEMAS[0]))
    matcher = grammars.matcher(good)
    with pytest.raises(GrammarError):
        matcher.accept(END)  # an end before the object: the grammar refuses it


def test_numbers_end_however_a_reply_repeats_a_digit(grammars, tokenizer):
    """A walk that always picks a digit token where one is allowed still ends: numbers are
    bounded to MAX_INTEGER_DIGITS and MAX_FRACTION_DIGITS digits, and stay valid."""
    digits = [t for t in range(tokenizer.get_vocab_size()) if tokenizer.decode([t]) == "2"]
    for schema in ({"type": "number"}, {"type": "integer"}, {"type": "number", "minimum": 0.5},
                   {"type": ["number", "null"], "maximum": 3}):  # fmt: skip
        matcher = grammars.matcher(Constraint.json_schema(schema))
        text = ""
        for _ in range(60):
            choices = allowed(matcher.bitmask())
            pick = [t for t in digits if t in choices] or [t for t in choices if t != END]
            if not pick or tokenizer.decode([pick[0]]) not in "0123456789.":
                break
            if pick[0] not in digits and "." in text:
                break
            matcher.accept(pick[0])
            text += tokenizer.decode([pick[0]])
        assert END in allowed(matcher.bitmask()), (schema, text)
        assert len(text.replace(".", "")) <= MAX_INTEGER_DIGITS + MAX_FRACTION_DIGITS + 1
        jsonschema.validate(json.loads(text), schema)


def test_bounding_numbers_keeps_the_schemas_own_bounds():
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 1e20},
            "k": {"type": "integer", "maximum": 7},
            "e": {"enum": [{"type": "number"}]},
        },
    }
    assert bounded_numbers(schema)["properties"] == {
        "n": {"type": "number", "multipleOf": 0.5, "exclusiveMinimum": 1e20},
        "k": {"type": "integer", "maximum": 7, "minimum": -(10**MAX_INTEGER_DIGITS - 1)},
        "e": {"enum": [{"type": "number"}]},  # data, left alone
    }  # fmt: skip
