"""One serialisable constraint for a reply, whatever request field asked for it.

OpenAI's `response_format`, vLLM's `structured_outputs` and the older `guided_*` fields all
become a `Constraint` once, in the front end; everything after (the grammar cache, the engine's
masks) reads only this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class Constraint:
    """`kind` one of KINDS; `value` the schema as JSON text, the regular expression, the
    choices as a JSON list of strings, or the grammar (Lark, or GBNF/EBNF with `::=`); empty
    for json_object. Equal constraints compile to one cached grammar."""

    kind: str
    value: str = ""
    # A reasoning model's thinking comes before the constrained answer (vLLM applies the
    # constraint after the reasoning ends): free text up to and including `think_end`, then
    # the answer. With `think_start` the reply opens the block itself, and may skip it; without,
    # the prompt opened it and the reply begins inside. Empty: no reasoning before. Each marker
    # as a grammar writes it: a JSON string literal, or `<[id]>` where it is one token of its
    # own in the vocabulary (the grammar library reads such a token as no text).
    think_start: str = ""
    think_end: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown constraint kind {self.kind!r}; kinds: {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> Constraint:
        return cls("json_schema", json.dumps(schema, separators=(",", ":")))

    @classmethod
    def choice(cls, choices: list[str]) -> Constraint:
        return cls("choice", json.dumps(list(choices), ensure_ascii=False))
