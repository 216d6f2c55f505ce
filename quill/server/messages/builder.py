"""A Messages API reply, built from the reply's parts as they come, with Anthropic's stream
events on the way.

The stream: `message_start` (the message with no content yet), `ping`, then per content block
`content_block_start`, `content_block_delta`... (`thinking_delta`, `text_delta`,
`input_json_delta`), `content_block_stop`; then `message_delta` (stop reason, usage) and
`message_stop`. A block is thinking, text, or a `tool_use` whose `input` is the call's
arguments as an object.
"""

from __future__ import annotations

import uuid

from quill.server.reply_parts import CALL, REASONING, TEXT, Part, PartEvent


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, cached_tokens: int, output_tokens: int) -> dict:
    """Anthropic's usage: `input_tokens` are the prompt's tokens not read from the cache, so
    that input + cache reads is the whole prompt."""
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
        "output_tokens": output_tokens,
    }


class MessageBuilder:
    def __init__(self, model: str) -> None:
        self.id = new_id("msg")
        self.model = model
        self.content: list[dict] = []
        self._block_of: dict[int, int] = {}  # part index -> its block's index
        self.stop_reason: str | None = None
        self.stop_sequence: str | None = None
        self.usage = usage(0, 0, 0)

    def snapshot(self) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [dict(block) for block in self.content],
            "stop_reason": self.stop_reason,
            "stop_sequence": self.stop_sequence,
            "usage": dict(self.usage),
        }

    def start(self, prompt_tokens: int) -> list[dict]:
        self.usage = usage(prompt_tokens, 0, 0)
        return [{"type": "message_start", "message": self.snapshot()}, {"type": "ping"}]

    def apply(self, events: list[PartEvent]) -> list[dict]:
        out = []
        for e in events:
            if e.kind == "open":
                out.append(self._open(e.part))
            elif e.kind == "delta":
                out.append(self._delta(e.part, e.piece))
            else:
                out.append(self._close(e.part))
        return out

    def _open(self, part: Part) -> dict:
        if part.kind == REASONING:
            block = {"type": "thinking", "thinking": "", "signature": ""}
        elif part.kind == TEXT:
            block = {"type": "text", "text": ""}
        else:
            block = {"type": "tool_use", "id": part.call_id, "name": part.name, "input": {}}
        self._block_of[part.index] = len(self.content)
        self.content.append(block)
        return {"type": "content_block_start", "index": len(self.content) - 1,
                "content_block": dict(block)}  # fmt: skip

    def _delta(self, part: Part, piece: str) -> dict:
        index = self._block_of[part.index]
        block = self.content[index]
        if part.kind == REASONING:
            block["thinking"] = part.text
            delta = {"type": "thinking_delta", "thinking": piece}
        elif part.kind == TEXT:
            block["text"] = part.text
            delta = {"type": "text_delta", "text": piece}
        else:
            delta = {"type": "input_json_delta", "partial_json": piece}
        return {"type": "content_block_delta", "index": index, "delta": delta}

    def _close(self, part: Part) -> dict:
        index = self._block_of[part.index]
        if part.kind == CALL:
            self.content[index]["input"] = part.arguments()
        return {"type": "content_block_stop", "index": index}

    def finish(
        self, finish_reason: str | None, stop: str | int | None, called: bool, usage: dict
    ) -> list[dict]:
        """The closing events: the stop reason (tool_use when the reply called a tool,
        max_tokens, stop_sequence with the string that matched, else end_turn) and usage."""
        if called:
            self.stop_reason = "tool_use"
        elif finish_reason == "length":
            self.stop_reason = "max_tokens"
        elif isinstance(stop, str):
            self.stop_reason, self.stop_sequence = "stop_sequence", stop
        else:
            self.stop_reason = "end_turn"
        self.usage = usage
        delta = {"stop_reason": self.stop_reason, "stop_sequence": self.stop_sequence}
        return [{"type": "message_delta", "delta": delta, "usage": dict(usage)},
                {"type": "message_stop"}]  # fmt: skip
