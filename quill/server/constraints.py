"""The request fields that constrain a reply, read into one `Constraint` (or a 400 that names
the field and says why).

OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict", "description"}}. vLLM: `structured_outputs` with one of `json`,
`regex`, `choice`, `grammar`, `json_object`; the older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` as aliases. One constraint a request; the grammar is
checked here (llguidance, without the tokenizer) so that a bad one is the client's 400 at once.
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.structured.grammar import GrammarError, grammar_text

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED)
_STRUCTURED_KEYS = {"json", "regex", "choice", "grammar", "json_object"}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def constraint_of(fields: dict[str, Any]) -> Constraint | None:
    """`fields`: the request's response_format, structured_outputs and guided_* values."""
    found = [(name, value) for name, value in fields.items() if _asks(name, value)]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(
            f"only one kind of constraint a request: {names} were given", param=found[1][0]
        )
    if not found:
        return None
    name, value = found[0]
    return checked(_read(name, value), name)


def checked(constraint: Constraint, param: str) -> Constraint:
    """`constraint` if llguidance can enforce it, else a 400 naming `param` with its reason."""
    try:
        problem = llguidance.LLMatcher.validate_grammar(grammar_text(constraint))
    except GrammarError as e:
        problem = str(e)
    if problem and not problem.startswith("WARNING"):
        raise InvalidRequestError(f"{param}: {problem}", param=param)
    return constraint


def _asks(name: str, value: Any) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return value.get("type") != "text"
    if name == "structured_outputs":
        return any(value.get(k) not in (None, False) for k in _STRUCTURED_KEYS)
    return True


def _read(name: str, value: Any) -> Constraint:
    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(message, param=name)

    if name == "response_format":
        kind = value.get("type")
        if kind == "json_object":
            return Constraint("json_object")
        if kind != "json_schema":
            raise bad(
                f"response_format type must be text, json_object or json_schema, not {kind!r}"
            )
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad("When response_format type is 'json_schema', the 'json_schema' field "
                      "must be provided.")  # fmt: skip
        if not isinstance(spec.get("name"), str) or not _NAME.fullmatch(spec["name"]):
            raise bad("response_format.json_schema.name must be 1-64 letters, digits, _ or -")
        schema = spec.get("schema")
        return Constraint("json_object") if schema is None else _schema(schema, bad)
    if name == "structured_outputs":
        given = [k for k in _STRUCTURED_KEYS if value.get(k) not in (None, False)]
        if len(given) > 1:
            raise bad(f"structured_outputs takes one of json, regex, choice, grammar, "
                      f"json_object; got {', '.join(sorted(given))}")  # fmt: skip
        key = given[0]
        if key == "json_object":
            return Constraint("json_object")
        return _read(f"guided_{key}", value[key]) if key != "json" else _schema(value[key], bad)
    if name == "guided_json":
        return _schema(value, bad)
    if name == "guided_choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise bad(f"{name} must be a non-empty list of strings")
        return Constraint.choice(value)
    if not isinstance(value, str) or not value:
        raise bad(f"{name} must be a non-empty string")
    return Constraint("regex" if name == "guided_regex" else "grammar", value)


def _schema(schema: Any, bad) -> Constraint:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise bad(f"the JSON schema is not JSON: {e}") from e
    if not isinstance(schema, dict | bool):
        raise bad("a JSON schema must be an object")
    return Constraint.json_schema(schema)
