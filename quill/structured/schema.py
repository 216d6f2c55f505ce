"""JSON schemas as quill enforces them: every number bounded in its digits. Plain Python (no
grammar library), so the front end writes the same bounds into the grammars it builds."""

from __future__ import annotations

# A number in a JSON reply has at most this many digits before and after its point (as in
# llama.cpp's JSON grammars): a model that repeats a digit, as small models do, must end the
# number instead of writing it until max_tokens. A schema's own bounds and multipleOf stand.
MAX_INTEGER_DIGITS = 15
MAX_FRACTION_DIGITS = 10
_LARGEST = 10**MAX_INTEGER_DIGITS - 1
# Keywords whose values are data, not schemas: never rewritten.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def bounded_numbers(schema):
    """`schema` with every number and integer it declares bounded to MAX_INTEGER_DIGITS and
    MAX_FRACTION_DIGITS digits (a reply valid for the result is valid for `schema`)."""
    if isinstance(schema, list):
        return [bounded_numbers(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _DATA_KEYWORDS else bounded_numbers(v) for k, v in schema.items()}
    types = schema.get("type")
    types = {types} if isinstance(types, str) else set(types) if isinstance(types, list) else set()
    if types & {"number", "integer"}:
        low = _bound(out, "minimum", "exclusiveMinimum")
        high = _bound(out, "maximum", "exclusiveMaximum")
        if low is None and (high is None or high >= -_LARGEST):
            out["minimum"] = -_LARGEST
        if high is None and (low is None or low <= _LARGEST):
            out["maximum"] = _LARGEST
        if "number" in types and "multipleOf" not in out:
            out["multipleOf"] = float(f"1e-{MAX_FRACTION_DIGITS}")
    return out


def _bound(schema: dict, inclusive: str, exclusive: str) -> float | None:
    """The schema's own bound on one side, if it has one (a number; True is draft 4's flag)."""
    for key in (inclusive, exclusive):
        value = schema.get(key)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return value
    return None
