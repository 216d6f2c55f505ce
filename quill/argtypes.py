"""Value types for the commands' flags, shared by `quill simulate` and `quill bench serve`.

argparse shows a type's ValueError as a bare "invalid value"; `checked` turns it into the
message the parser prints, naming the flag, so a typo ends in one clear line.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def checked(parse: Callable[[str], T], what: str) -> Callable[[str], T]:
    """`parse` as an argparse type whose errors name `what`."""

    def convert(text: str) -> T:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"{what}: {e}") from None

    convert.__name__ = what  # argparse names the type in some messages
    return convert


def rate(text: str) -> float:
    """A positive rate; `inf` (everything at once) allowed."""
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise ValueError(f"must be positive (or inf), got {text!r}")
    return value


def positive(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"must be positive and finite, got {text!r}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(f"must be >= 1, got {text!r}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise ValueError(f"must be >= 0, got {text!r}")
    return value
