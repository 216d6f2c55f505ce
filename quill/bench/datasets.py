"""The prompts a benchmark sends: random ones of set token lengths, or read from a file.

Files are ShareGPT conversations or plain prompts, as a JSON list or as JSONL (one object a
line); each object is either shape:

    {"conversations": [{"from": "human", "value": "..."}, {"from": "gpt", "value": "..."}]}
    {"prompt": "...", "output_len": 128}          (output_len optional)

A conversation's first human turn is the prompt; the first gpt turn after it is the reply
whose token count is the output length (unless the run fixes one). Conversations with no human
turn, or with no reply when one is needed, are skipped, as real ShareGPT dumps have many.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quill.bench.prompts import ExactPrompts
from quill.sim.workload import LengthSpec


@dataclass(frozen=True)
class BenchRequest:
    """One request to send: its prompt text, its tokens as the tokenizer counts them, and how
    many tokens to ask for."""

    prompt: str | list[int]  # text, or token ids (completions only)
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class DatasetEntry:
    """A prompt read from a file, with its output length or the reply to measure it by."""

    prompt: str
    output_len: int | None = None
    reply: str | None = None


def random_requests(
    n: int,
    input_len: LengthSpec,
    output_len: LengthSpec,
    prompts: ExactPrompts,
    seed: int,
    prefix_len: int = 0,
) -> list[BenchRequest]:
    """`n` random prompts, each of a length drawn from `input_len` (exactly, in tokens), after
    one random prefix of `prefix_len` tokens that they all share (as vLLM's
    --random-prefix-len: a system prompt, say)."""
    lengths = random.Random(f"quill-bench:{seed}:lengths")
    texts = random.Random(f"quill-bench:{seed}:prompts")
    prefix = prompts.make(prefix_len, texts) if prefix_len else ""
    out = []
    for _ in range(n):
        prompt_len, reply_len = input_len.draw(lengths), output_len.draw(lengths)
        if prefix:
            text = prompts.make_after(prefix, prefix_len + prompt_len, texts)
        else:
            text = prompts.make(prompt_len, texts)
        out.append(BenchRequest(text, prefix_len + prompt_len, reply_len))
    return out


def read_dataset(path: str | Path) -> list[DatasetEntry]:
    """Every usable entry of a ShareGPT or prompt file (JSON list or JSONL), in file order.
    Raises ValueError naming the record at fault for one that is neither shape."""
    path = Path(path)
    text = path.read_text()
    if text.lstrip().startswith("["):
        try:
            records = list(enumerate(json.loads(text), 1))
        except ValueError as e:
            raise ValueError(f"{path}: not JSON: {e}") from None
        where = "record"
    else:
        records = []
        for number, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append((number, json.loads(line)))
                except ValueError as e:
                    raise ValueError(f"{path} line {number}: not JSON: {e}") from None
        where = "line"
    entries = []
    for number, record in records:
        try:
            entry = _entry(record)
        except ValueError as e:
            raise ValueError(f"{path} {where} {number}: {e}") from None
        if entry is not None:
            entries.append(entry)
    return entries


def _entry(record: object) -> DatasetEntry | None:
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    if "conversations" in record:
        return _conversation(record["conversations"])
    if "prompt" not in record:
        raise ValueError('expected "conversations" (ShareGPT) or "prompt"')
    prompt, output_len = record["prompt"], record.get("output_len")
    if not isinstance(prompt, str):
        raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
    if output_len is not None and (
        isinstance(output_len, bool) or not isinstance(output_len, int) or output_len < 1
    ):
        raise ValueError(f"output_len must be an integer >= 1, got {output_len!r}")
    return DatasetEntry(prompt, output_len)


def _conversation(turns: object) -> DatasetEntry | None:
    if not isinstance(turns, list):
        raise ValueError("conversations must be a list of turns")
    prompt = None
    for turn in turns:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise ValueError('every turn must be an object with a string "value"')
        if prompt is None and turn.get("from") == "human":
            prompt = turn["value"]
        elif prompt is not None and turn.get("from") == "gpt":
            return DatasetEntry(prompt, reply=turn["value"])
    return None if prompt is None else DatasetEntry(prompt)


def sample_requests(
    entries: list[DatasetEntry],
    n: int,
    output_len: LengthSpec | None,
    seed: int,
    count_prompt: Callable[[str], int],
    count_reply: Callable[[str], int],
) -> list[BenchRequest]:
    """`n` requests from a file's entries, in an order shuffled by `seed`; when the file has
    fewer usable entries than `n`, the shuffled list repeats. `output_len`, when given,
    overrides what the file says. `count_prompt` counts a prompt's tokens as the server will
    (with any BOS); `count_reply` a reply's, as generated tokens (without)."""
    rng = random.Random(f"quill-bench:{seed}:dataset")
    usable = [e for e in entries if output_len is not None or e.output_len is not None or e.reply]
    if not usable:
        raise ValueError(
            "no entry of the dataset has an output length (an output_len, or a ShareGPT "
            "reply): give --output-len"
        )
    order = list(range(len(usable)))
    rng.shuffle(order)
    out = []
    for k in range(n):
        entry = usable[order[k % len(order)]]
        if output_len is not None:
            reply_len = output_len.draw(rng)
        elif entry.output_len is not None:
            reply_len = entry.output_len
        else:
            reply_len = max(count_reply(entry.reply), 1)
        out.append(BenchRequest(entry.prompt, count_prompt(entry.prompt), reply_len))
    return out
