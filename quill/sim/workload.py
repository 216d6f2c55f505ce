"""The requests a simulation serves: when each arrives, how long its prompt and reply are, and
which prompts share a leading prefix.

A workload is only numbers (arrival time, prompt length, reply length, shared prefix), never
text, so 100,000 of them are cheap; the simulator turns each into an engine Request only when
it arrives. The same seed gives the same workload, and arrival times scale with 1/rate, so runs
at two rates differ only in their pace (the capacity search relies on this).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path


@dataclass(slots=True)
class WorkItem:
    """One request of a workload. Requests with the same `prefix_id` share their first
    `prefix_tokens` prompt tokens (0 < prefix_tokens <= prompt_tokens; 0 without a prefix_id),
    so the engine's prefix cache can skip computing them again; the rest of every prompt is
    its own."""

    request_id: str
    arrival_time: float
    prompt_tokens: int
    output_tokens: int
    prefix_id: str | int | None = None
    prefix_tokens: int = 0


@dataclass(frozen=True)
class LengthSpec:
    """A token count, fixed (`256`) or drawn uniformly from integers in `MIN:MAX`."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        text = str(text).strip()
        low_text, sep, high_text = text.partition(":")
        try:
            low = int(low_text)
            high = int(high_text) if sep else low
        except ValueError:
            raise ValueError(f"not a token count or MIN:MAX: {text!r}") from None
        if low < 1 or high < low:
            raise ValueError(f"need 1 <= MIN <= MAX, got {text!r}")
        return cls(low, high)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def arrival_times(
    num_requests: int, rate: float, burstiness: float = 1.0, seed: int = 0
) -> Iterator[float]:
    """Seconds from the start at which each request arrives: the first at 0, then gamma
    inter-arrival times of shape `burstiness` and mean 1/rate (shape 1 is a Poisson process;
    below 1 burstier, above 1 more even: the coefficient of variation is 1/sqrt(shape)). With an
    infinite rate all arrive at 0. The one arrival process of the simulator and of
    `quill bench serve`. Generated lazily."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"request rate must be positive (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be positive and finite, got {burstiness}")
    rng = random.Random(f"quill-sim:{seed}:arrivals")
    scale = 0.0 if math.isinf(rate) else 1.0 / rate
    t = 0.0
    for i in range(num_requests):
        if i:
            t += rng.gammavariate(burstiness, 1.0 / burstiness) * scale  # mean-1 gap, scaled
        yield t


def synthetic(
    num_requests: int,
    rate: float,
    prompt: LengthSpec,
    output: LengthSpec,
    burstiness: float = 1.0,
    seed: int = 0,
    *,
    prefix_tokens: int = 0,
    num_prefixes: int = 1,
) -> Iterator[WorkItem]:
    """Requests arriving at `rate` per second (see `arrival_times`) with prompt and reply
    lengths drawn from their specs. With `prefix_tokens` N > 0, request i shares its first
    min(N, prompt) tokens with every request of prefix_id i % `num_prefixes` (a system prompt
    of up to N tokens). Generated lazily."""
    if prefix_tokens < 0:
        raise ValueError(f"prefix tokens must be >= 0, got {prefix_tokens}")
    if num_prefixes < 1:
        raise ValueError(f"the number of prefixes must be >= 1, got {num_prefixes}")
    # Separate streams: the arrival pattern does not change when the lengths do, and vice versa.
    lengths = random.Random(f"quill-sim:{seed}:lengths")
    for i, t in enumerate(arrival_times(num_requests, rate, burstiness, seed)):
        item = WorkItem(str(i), t, prompt.draw(lengths), output.draw(lengths))
        if prefix_tokens:
            item.prefix_id = i % num_prefixes
            item.prefix_tokens = min(prefix_tokens, item.prompt_tokens)
        yield item


# -- traces --------------------------------------------------------------------------------
_TRACE_KEYS = {"arrival_time", "prompt_tokens", "output_tokens", "prefix_id", "prefix_tokens"}


def read_trace(
    path: str | Path,
    limit: int | None = None,
    check: Callable[[int, int], str | None] | None = None,
) -> list[WorkItem]:
    """A JSONL trace, one object per request, sorted by arrival time (stably). Raises
    ValueError naming the line of the first bad record, or of the first one that `check`
    (prompt tokens, output tokens) -> reason rejects."""
    path = Path(path)
    items: list[WorkItem] = []
    with path.open() as f:
        for number, line in enumerate(f, 1):
            if limit is not None and len(items) >= limit:
                break
            if not line.strip():
                continue
            try:
                item = _parse_record(json.loads(line), len(items))
                reason = check and check(item.prompt_tokens, item.output_tokens)
                if reason:
                    raise ValueError(reason)
            except ValueError as e:  # JSONDecodeError is one
                raise ValueError(f"{path} line {number}: {e}") from None
            items.append(item)
    items.sort(key=lambda item: item.arrival_time)
    return items


def _parse_record(record, index: int) -> WorkItem:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    unknown = sorted(set(record) - _TRACE_KEYS)
    if unknown:
        raise ValueError(f"unknown keys {unknown}; known: {sorted(_TRACE_KEYS)}")
    missing = sorted({"arrival_time", "prompt_tokens", "output_tokens"} - set(record))
    if missing:
        raise ValueError(f"missing {', '.join(missing)}")
    arrival = record["arrival_time"]
    if isinstance(arrival, bool) or not isinstance(arrival, int | float):
        raise ValueError(f"arrival_time must be a number, got {arrival!r}")
    if not (math.isfinite(arrival) and arrival >= 0):
        raise ValueError(f"arrival_time must be >= 0 and finite, got {arrival!r}")
    counts = []
    for key in ("prompt_tokens", "output_tokens"):
        value = record[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{key} must be an integer >= 1, got {value!r}")
        counts.append(value)
    prefix = record.get("prefix_id")
    shared = record.get("prefix_tokens")
    if prefix is None and shared is None:
        return WorkItem(str(index), float(arrival), counts[0], counts[1])
    if isinstance(prefix, bool) or not isinstance(prefix, str | int):
        if prefix is None:
            raise ValueError("prefix_tokens needs a prefix_id (the prefix it counts)")
        raise ValueError(f"prefix_id must be a string or an integer, got {prefix!r}")
    if shared is None:
        raise ValueError("prefix_id needs prefix_tokens (how many leading tokens it shares)")
    if isinstance(shared, bool) or not isinstance(shared, int) or not 1 <= shared <= counts[0]:
        raise ValueError(
            f"prefix_tokens must be an integer in [1, prompt_tokens={counts[0]}], got {shared!r}"
        )
    return WorkItem(str(index), float(arrival), counts[0], counts[1], prefix, shared)


def write_trace(items: Iterable[WorkItem], path: str | Path) -> None:
    """The inverse of read_trace (request ids are positions, so they are not written)."""
    with Path(path).open("w") as f:
        for item in items:
            record = {
                "arrival_time": item.arrival_time,
                "prompt_tokens": item.prompt_tokens,
                "output_tokens": item.output_tokens,
            }
            if item.prefix_id is not None:
                record["prefix_id"] = item.prefix_id
                record["prefix_tokens"] = item.prefix_tokens
            f.write(json.dumps(record) + "\n")
