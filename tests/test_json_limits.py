"""The bounds on JSON inside requests (quill/frontend/json_limits.py), on hand-made values at
and past each bound, and the guard's cookie reader against Python's own on ordinary headers."""

from __future__ import annotations

from http.cookies import SimpleCookie

import pytest
from hypothesis import given
from hypothesis import strategies as st

from quill.contract.errors import InvalidRequestError
from quill.frontend.json_limits import JsonLimits
from quill.server.guard import cookie_value

LIMITS = JsonLimits(max_json_depth=4, max_json_values=10, max_schema_refs=2, max_grammar_chars=8)


def nest(depth: int):
    value = 0
    for _ in range(depth):
        value = [value]
    return value


def test_depth_values_and_refs_at_and_past_their_bounds():
    LIMITS.check_value(nest(4), "f")  # [[[[0]]]]: four containers
    with pytest.raises(InvalidRequestError, match="more than 4 levels.*--max-json-depth") as e:
        LIMITS.check_value(nest(5), "f")
    assert e.value.param == "f"
    LIMITS.check_value(list(range(9)), "f")  # the list and its nine items: ten values
    with pytest.raises(InvalidRequestError, match="more than 10 values.*--max-json-values"):
        LIMITS.check_value(list(range(10)), "f")
    with pytest.raises(InvalidRequestError, match="more than 10 values"):
        LIMITS.check_value({"a": {"b": 1, "c": 2}, "d": [1, 2, 3, 4, 5, 6]}, "f")  # 11
    refs = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#"}}}
    LIMITS.check_value(refs, "f")
    refs["$ref"] = "#/$defs/a"
    with pytest.raises(InvalidRequestError, match="more than 2 \\$ref.*--max-schema-refs"):
        LIMITS.check_value(refs, "f")
    LIMITS.check_text("a" * 8, "g", "the grammar")
    with pytest.raises(InvalidRequestError, match="9 characters.*--max-grammar-chars"):
        LIMITS.check_text("a" * 9, "g", "the grammar")


def test_a_value_past_every_bound_is_walked_only_up_to_the_first():
    """A million-item list is refused at the first bound, without walking its items."""
    huge = [nest(50)] * 1_000_000
    with pytest.raises(InvalidRequestError, match="values"):
        JsonLimits(max_json_values=100).check_value(huge, "f")


def test_text_is_parsed_within_the_bounds():
    assert JsonLimits().parse_text('{"a": [1, 2]}', "f") == {"a": [1, 2]}
    with pytest.raises(InvalidRequestError, match="not JSON") as e:
        JsonLimits().parse_text("{'a': 1}", "f")
    assert e.value.param == "f"
    with pytest.raises(InvalidRequestError, match="levels"):
        JsonLimits().parse_text("[" * 100_000 + "]" * 100_000, "f")  # past Python's recursion
    with pytest.raises(InvalidRequestError, match="levels"):
        LIMITS.parse_text("[[[[[0]]]]]", "f")
    with pytest.raises(InvalidRequestError, match="string of JSON"):
        LIMITS.parse_text(3, "f")


@given(
    st.dictionaries(
        st.text("abcXYZ_", min_size=1, max_size=6),
        st.text("abcdef0123456789-_.", max_size=12),
        max_size=4,
    )
)
def test_the_cookie_reader_agrees_with_pythons_on_ordinary_headers(cookies):
    header = "; ".join(f"{k}={v}" for k, v in cookies.items())
    parsed = SimpleCookie()
    parsed.load(header)
    for name in cookies:
        assert cookie_value(header, name) == parsed[name].value
    assert cookie_value(header, "absent") is None
    assert cookie_value('x=1; quill_console="abc"', "quill_console") == "abc"
