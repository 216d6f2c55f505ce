"""Reasoning in a reply: the thinking a model writes before its answer, split from the answer.

Reasoning models write `<think> ... </think>` and then the answer. Returned as `content`, the
thinking reaches the user and breaks JSON parsers, so quill splits it into `reasoning_content`
(and `reasoning`, the newer name) as vLLM's `--reasoning-parser` does. The formats (vLLM's
names): `qwen3` (Qwen3 and QwQ: the reply opens the block itself unless the prompt did or
thinking was turned off), `deepseek_r1` (the R1 distills: the template opens the block at the
end of the prompt, so the reply begins inside it). Both read the same way here: whether the
reply begins inside the block is read off the prompt (it ends with the opening marker), so a
template of either kind is split right.

The stream and the whole reply go through one `ReasoningSplit`, so they agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from quill.frontend.text_reader import StateReader, partial_suffix

# The APIs' effort levels (OpenAI's `reasoning.effort`, Anthropic's `output_config.effort`) as
# the thinking a reply may spend: a token budget, after which the end marker is forced (None:
# no cap). "none" is not here: it turns thinking off where the template has the switch.
EFFORT_BUDGETS: dict[str, int | None] = {
    "minimal": 256,
    "low": 1024,
    "medium": 4096,
    "high": None,
    "xhigh": None,
    "max": None,
}


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"

    def opened_by(self, prompt_text: str) -> bool:
        """Whether the prompt leaves the reply inside the reasoning block."""
        return prompt_text.rstrip().endswith(self.start)

    def closed_by(self, prompt_text: str) -> bool:
        """Whether the prompt holds the block already closed (thinking turned off)."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.end)

    def splitter(self, opened: bool) -> ReasoningSplit:
        return ReasoningSplit(self, opened)


REASONING_FORMATS = {f.name: f for f in (ReasoningFormat("qwen3"), ReasoningFormat("deepseek_r1"))}


def detect_reasoning_format(template: str | None) -> ReasoningFormat | None:
    """The reasoning format a chat template writes (None: the model does not reason)."""
    if not template or "</think>" not in template:
        return None
    if "enable_thinking" in template or "reasoning_content" in template:
        return REASONING_FORMATS["qwen3"]
    return REASONING_FORMATS["deepseek_r1"]


class ReasoningSplit(StateReader):
    """One reply's text, split as it arrives into reasoning and answer. What either holds is
    safe to send: a marker still forming is held back, and leading whitespace of each part
    waits until text follows it."""

    def __init__(self, fmt: ReasoningFormat, opened: bool) -> None:
        super().__init__("inside" if opened else "maybe")
        self.fmt = fmt
        self._reasoning = ""
        self._content = ""

    def finish(self) -> None:
        self.finished = True
        self._read()
        rest = self.text[self.pos :]
        self.pos = len(self.text)
        if self.state == "inside":
            self._reasoning += rest  # never closed: all of it was thinking
        else:
            self._content += rest

    def _maybe(self) -> None:
        """At the reply's start: the opening marker, or the answer."""
        start = self.fmt.start
        stripped = self.text[self.pos :].lstrip()
        if stripped.startswith(start):
            self.pos = len(self.text) - len(stripped) + len(start)
            self.state = "inside"
        elif not (start.startswith(stripped) and not self.finished):
            self.state = "answer"

    def _inside(self) -> None:
        rest, end = self.text[self.pos :], self.fmt.end
        found = rest.find(end)
        if found >= 0:
            self._reasoning += rest[:found]
            self.pos += found + len(end)
            self.state = "answer"
        else:
            keep = partial_suffix(rest, end)
            self._reasoning += rest[: len(rest) - keep]
            self.pos += len(rest) - keep

    def _answer(self) -> None:
        self._content += self.text[self.pos :]
        self.pos = len(self.text)

    def reasoning(self) -> str:
        """The thinking so far, leading whitespace held until text follows."""
        return self._reasoning.lstrip()

    def content(self) -> str:
        """The answer so far, leading whitespace held until text follows."""
        return self._content.lstrip()
