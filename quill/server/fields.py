"""The field policy every request schema follows, and the base class that enforces it.

What a client can rely on:
- A field quill implements is parsed strictly (no "16" for 16, no 1 for true, an object where
  an object belongs) and range-checked against what the engine can represent (64-bit
  integers, finite floats); a bad value is a 400 naming the field. No code past the schema
  sees a value of another shape than its type says.
- OpenAI's fields and vLLM's extensions that benchmark clients and SDKs send are implemented
  with their meaning (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stream_options
  with continuous_usage_stats, include_stop_str_in_output, skip_special_tokens, ...).
- A field quill knows but does not implement is a 400 when ignoring it would silently change
  the result (`UNSUPPORTED`: functions, beam search, ...), and accepted when its value asks for
  nothing (an empty list, false, null).
- A field quill does not know is ignored, as vLLM does, and named in a warning in the log
  (`ignored_fields`): a client written for a newer API still works.
- JSON inside a field (schemas, tools, call arguments, grammars) is bounded by the server's
  `JsonLimits`, given to validation as its context (`{"limits": ...}`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    model_validator,
)

from quill.contract.errors import InvalidRequestError
from quill.frontend.json_limits import DEFAULT_LIMITS, JsonLimits

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]

# Known fields that change what is generated and that quill does not implement: refused when
# they ask for something, so that ignoring them never changes a result silently.
UNSUPPORTED: dict[str, str] = {
    "functions": "functions (function calling) are not supported",
    "function_call": "function_call is not supported",
    "use_beam_search": "beam search is not supported",
    "bad_words": "bad_words is not supported",
    "allowed_token_ids": "allowed_token_ids is not supported",
    "logits_processors": "logits_processors are not supported",
    "prediction": "predicted outputs are not supported",
    "audio": "audio output is not supported",
    "chat_template": "a per-request chat_template is not supported",
    "continue_final_message": "continue_final_message is not supported",
}


def _asks_for_something(value: Any) -> bool:
    # Identity for None and False: 0 is a request too (logprobs=0 asks for the chosen ones).
    return not (value is None or value is False or value in ("", [], {}))


def ignored_fields(model: BaseModel, prefix: str = "") -> list[str]:
    """Dotted names of the fields a parsed request carried that quill does not know."""
    names = [prefix + k for k in (model.model_extra or {})]
    for name in type(model).model_fields:
        value = getattr(model, name)
        items = value if isinstance(value, list) else [value]
        for i, item in enumerate(items):
            if isinstance(item, BaseModel):
                index = f".{i}" if isinstance(value, list) else ""
                names += ignored_fields(item, f"{prefix}{name}{index}.")
    return names


def limits_of(info: ValidationInfo | None) -> JsonLimits:
    """The JSON limits validation was given (the defaults when none)."""
    context = info.context if info is not None else None
    return (context or {}).get("limits") or DEFAULT_LIMITS


class Lenient(BaseModel):
    """Known fields strict; unknown ones kept aside (model_extra) to be named and ignored."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="after")
    def _refuse_unsupported(self):
        for name, value in (self.model_extra or {}).items():
            if name in UNSUPPORTED and _asks_for_something(value):
                raise InvalidRequestError(UNSUPPORTED[name], param=name)
        return self


def member(model: type, name: str):
    """A union member tagged `name` (see `by_type`)."""
    return Annotated[model, Tag(f"[{name}]")]


def by_type(known: Iterable[str], missing: str = "", other: str = "other") -> Discriminator:
    """A union's discriminator by the value's "type": its own tag for a `known` type, the
    `missing` one's when no type is given, `other` else (a member that refuses it by name).
    Tags are bracketed, so that an error's location leaves them out (quill.server.errors): a
    bad role in the first input item is `input.0.role`."""
    names = set(known)

    def tag(value) -> str:
        kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
        kind = kind or missing
        return f"[{kind if kind in names else other}]"

    return Discriminator(tag)


def unsupported(what: str, param: str) -> InvalidRequestError:
    """A 400 naming `param`: "`what` not supported"."""
    return InvalidRequestError(f"{what} not supported", param=param)


def refused(name: str, what: str, param: str, note: str = "") -> type[Lenient]:
    """The union member for the types quill does not take: "`what` of type 'x': not
    supported`note`", a 400 naming `param` (`name`: the class's name in the schema)."""

    def _refuse(self):
        message = f"{what} of type {self.type!r}: not supported{note}"
        raise InvalidRequestError(message, param=param)

    return type(name, (Lenient,), {"__annotations__": {"type": str},
                                   "_refuse": model_validator(mode="after")(_refuse)})  # fmt: skip
