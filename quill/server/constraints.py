"""The request fields that constrain a reply, typed, bounded and read into one `Constraint`
(or a 400 that names the field and says why).

OpenAI: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict", "description"}}. vLLM: `structured_outputs` with one of `json`,
`regex`, `choice`, `grammar`, `json_object`; the older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` as aliases. OpenAI's `tools` and `tool_choice` are typed
here too: a tool call is one more constraint (quill/frontend/tools.py).

One constraint a request. Its JSON is bounded here (quill/frontend/json_limits.py); whether
the grammar library can enforce it is the engine's to say, which compiles it once, off its
loop, and times its first masks before it admits the request.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field

from quill.contract.constraint import Constraint
from quill.contract.errors import InvalidRequestError
from quill.frontend.json_limits import JsonLimits
from quill.server.fields import Lenient

GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *GUIDED, "tools")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


class JsonSchemaFormat(Lenient):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False,
                              populate_by_name=True)  # fmt: skip
    name: str
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Lenient):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Lenient):
    """vLLM's field: one of its constraint keys."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False,
                              populate_by_name=True)  # fmt: skip
    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    def given(self) -> list[str]:
        keys = {"json": self.json_, "regex": self.regex, "choice": self.choice,
                "grammar": self.grammar, "json_object": self.json_object}  # fmt: skip
        return [k for k, v in keys.items() if v is not None and v is not False]


class FunctionDefinition(Lenient):
    name: str
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class Tool(Lenient):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(Lenient):
    name: str


class NamedToolChoice(Lenient):
    type: Literal["function"]
    function: NamedFunction


ToolChoiceField = Literal["none", "auto", "required"] | NamedToolChoice


def constraint_of(fields: dict, limits: JsonLimits) -> tuple[str, Constraint] | None:
    """The constraint `fields` (response_format, structured_outputs and guided_* as parsed)
    ask for, with the field that asked; None when they ask for none."""
    found = [(name, value) for name, value in fields.items() if _asks(name, value)]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(
            f"only one kind of constraint a request: {names} were given", param=found[1][0]
        )
    if not found:
        return None
    name, value = found[0]
    return name, _read(name, value, limits)


def _asks(name: str, value) -> bool:
    if value is None:
        return False
    if name == "response_format":
        return value.type != "text"
    if name == "structured_outputs":
        return bool(value.given())
    return True


def _read(name: str, value, limits: JsonLimits) -> Constraint:
    def bad(message: str) -> InvalidRequestError:
        return InvalidRequestError(message, param=name)

    if name == "response_format":
        if value.type == "json_object":
            return Constraint("json_object")
        spec = value.json_schema
        if spec is None:
            raise bad("When response_format type is 'json_schema', the 'json_schema' field "
                      "must be provided.")  # fmt: skip
        if not _NAME.fullmatch(spec.name):
            raise bad("response_format.json_schema.name must be 1-64 letters, digits, _ or -")
        if spec.schema_ is None:
            return Constraint("json_object")
        return _schema(spec.schema_, name, limits)
    if name == "structured_outputs":
        given = value.given()
        if len(given) > 1:
            raise bad(f"structured_outputs takes one of json, regex, choice, grammar, "
                      f"json_object; got {', '.join(sorted(given))}")  # fmt: skip
        key = given[0]
        if key == "json_object":
            return Constraint("json_object")
        if key == "json":
            return _schema(value.json_, name, limits)
        return _read(f"guided_{key}", getattr(value, key), limits)
    if name == "guided_json":
        return _schema(value, name, limits)
    if name == "guided_choice":
        if not value:
            raise bad(f"{name} must be a non-empty list of strings")
        limits.check_value(value, name, "the list of choices")
        limits.check_text("".join(value), name, "the choices together")
        return Constraint.choice(value)
    if not value:
        raise bad(f"{name} must be a non-empty string")
    kind = "regex" if name == "guided_regex" else "grammar"
    limits.check_text(value, name, f"the {'regular expression' if kind == 'regex' else kind}")
    return Constraint(kind, value)


def _schema(schema: dict | bool | str, param: str, limits: JsonLimits) -> Constraint:
    if isinstance(schema, str):  # vLLM takes a schema as JSON text too
        schema = limits.parse_text(schema, param, "the JSON schema")
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object", param)
    else:
        limits.check_value(schema, param, "the JSON schema")
    return Constraint.json_schema(schema)
