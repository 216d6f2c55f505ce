"""Hypothesis strategies from JSON Schema: the subset pydantic writes into /openapi.json.

Our own small converter: object (properties, required, additionalProperties), anyOf, $ref into
the document's components, enum, const, and the scalar types with their bounds. Optional
properties are drawn present or absent. Unknown keywords are ignored, so a schema feature this
does not know widens what is drawn rather than failing.
"""

from __future__ import annotations

import math
import sys

from hypothesis import strategies as st

_SCALARS = {
    "null": st.none(),
    "boolean": st.booleans(),
    "string": st.text(max_size=12),
}


def from_schema(schema: dict, doc: dict) -> st.SearchStrategy:
    """Values valid under `schema`; `$ref`s resolve against `doc` ("#/components/...")."""
    if "$ref" in schema:
        target = doc
        for part in schema["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        return st.deferred(lambda: from_schema(target, doc))
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of([from_schema(s, doc) for s in schema["anyOf"]])
    kind = schema.get("type")
    if kind == "object" or "properties" in schema:
        return _object(schema, doc)
    if kind == "array":
        items = from_schema(schema.get("items", {}), doc)
        low = schema.get("minItems", 0)
        return st.lists(items, min_size=low, max_size=max(low, schema.get("maxItems", 3)))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        return st.floats(
            _bound(schema, "minimum", "exclusiveMinimum", math.inf),
            _bound(schema, "maximum", "exclusiveMaximum", -math.inf),
            allow_nan=False,
            allow_infinity=False,
            allow_subnormal=False,
        )
    if kind in _SCALARS:
        return _SCALARS[kind]
    return st.none() | st.booleans() | st.integers() | st.text(max_size=8)


def _bound(schema: dict, inclusive: str, exclusive: str, direction: float) -> float | None:
    """An inclusive bound; an exclusive one becomes the next normal float inside it."""
    if inclusive in schema:
        return schema[inclusive]
    if exclusive not in schema:
        return None
    value = math.nextafter(schema[exclusive], direction)
    if 0 < abs(value) < sys.float_info.min:  # subnormals are not drawn (flush-to-zero here)
        value = math.copysign(sys.float_info.min, value)
    return value


def _object(schema: dict, doc: dict) -> st.SearchStrategy:
    properties = schema.get("properties", {})
    required = set(schema.get("required", []))
    fixed = {k: from_schema(v, doc) for k, v in properties.items() if k in required}
    optional = {k: from_schema(v, doc) for k, v in properties.items() if k not in required}
    extra = schema.get("additionalProperties")
    base = st.fixed_dictionaries(fixed, optional=optional)
    if isinstance(extra, dict):  # a map such as metadata: draw a few entries
        return st.dictionaries(st.text(max_size=5), from_schema(extra, doc), max_size=2)
    return base
