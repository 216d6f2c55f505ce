"""Bounds on the JSON a client sends inside a request, checked before anything parses it
further or compiles it: one place for every schema, tool, call argument and grammar text.

Why: what reads these values recurses. The grammar library recurses on the C stack over a
schema's `$ref` chains and a Lark grammar's rule chains (a few thousand links overflowed an
8 MiB stack and took the server down); Python's own recursion (json, jinja's `tojson`,
quill's schema rewriting) raises past its limit. A value within these bounds is safe for all
of them, and the limits sit well above what real schemas use (OpenAI's structured outputs
allow 10 levels of nested objects, 5,000 properties and 1,000 enum values).

Every refusal is an `InvalidRequestError` naming the request's field, the limit and the flag
that sets it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quill.contract.errors import InvalidRequestError


@dataclass(frozen=True)
class JsonLimits:
    """What one value may hold; `quill serve`'s flags of the same names set them."""

    # Containers (objects and arrays) nested inside one another in one value.
    max_json_depth: int = 64
    # Values (containers, strings, numbers, ...) in one value, its whole tree counted.
    max_json_values: int = 100_000
    # "$ref" keys in one JSON schema (a chain of them is recursion in the grammar compiler).
    max_schema_refs: int = 1_000
    # Characters of a regular expression or grammar given as text.
    max_grammar_chars: int = 100_000

    def check_value(self, value, param: str, what: str = "the JSON value") -> None:
        """Raise InvalidRequestError(param) if `value` (parsed JSON) is past a bound."""
        depth, values, refs = _measure(value, self)
        if depth > self.max_json_depth:
            raise _refusal(param, f"{what} nests more than {self.max_json_depth} levels "
                           "deep", "--max-json-depth")  # fmt: skip
        if values > self.max_json_values:
            raise _refusal(param, f"{what} holds more than {self.max_json_values} values",
                           "--max-json-values")  # fmt: skip
        if refs > self.max_schema_refs:
            raise _refusal(param, f"{what} has more than {self.max_schema_refs} $ref "
                           "references", "--max-schema-refs")  # fmt: skip

    def parse_text(self, text: str, param: str, what: str = "the JSON text"):
        """`text` parsed as JSON within the bounds (a bad or unbounded text is a 400).

        Python's parser counts its own recursion (RecursionError, never a crash), so text
        nested past the interpreter's limit is refused like any other too deep.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"{param}: {what} must be a string of JSON", param)
        try:
            value = json.loads(text)
        except RecursionError:
            raise _refusal(param, f"{what} nests more than {self.max_json_depth} levels "
                           "deep", "--max-json-depth") from None  # fmt: skip
        except ValueError as e:
            raise InvalidRequestError(f"{param}: {what} is not JSON: {e}", param) from None
        self.check_value(value, param, what)
        return value

    def check_text(self, text: str, param: str, what: str) -> None:
        """A regular expression or grammar's length."""
        if len(text) > self.max_grammar_chars:
            raise _refusal(param, f"{what} has {len(text)} characters, more than "
                           f"{self.max_grammar_chars}", "--max-grammar-chars")  # fmt: skip


DEFAULT_LIMITS = JsonLimits()


def _refusal(param: str, message: str, flag: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message} (the server's limit: {flag})", param)


def _measure(value, limits: JsonLimits) -> tuple[int, int, int]:
    """(deepest nesting, number of values, number of "$ref" keys), walked without recursion;
    the walk stops as soon as a bound is passed (the figures then just exceed it)."""
    max_depth, num_values, num_refs = 0, 1, 0
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            if "$ref" in item:
                num_refs += 1
            children = item.values()
        elif isinstance(item, list | tuple):
            children = item
        else:
            continue
        depth += 1
        max_depth = max(max_depth, depth)
        num_values += len(children)
        if (
            max_depth > limits.max_json_depth
            or num_values > limits.max_json_values
            or num_refs > limits.max_schema_refs
        ):
            break
        stack.extend((child, depth) for child in children)
    return max_depth, num_values, num_refs
