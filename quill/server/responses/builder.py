"""A response object of the Responses API, built from the reply's parts as they come, with the
stream's typed events on the way.

Every event carries the next `sequence_number`. The order, per output item:
`response.output_item.added`, then for a message `response.content_part.added`,
`response.output_text.delta`..., `response.output_text.done`, `response.content_part.done`; for
a call `response.function_call_arguments.delta`... and `.done`; for reasoning
`response.reasoning_text.delta`... and `.done` (and the summary's events, when one was asked);
then `response.output_item.done`. Around them: `response.created`, `response.in_progress`, and
at the end `response.completed` (or `response.incomplete` when the reply hit
max_output_tokens, `response.failed` when it failed).
"""

from __future__ import annotations

import copy
import time
import uuid

from quill.server.reply_parts import CALL, REASONING, TEXT, Part, PartEvent
from quill.server.responses.protocol import (
    FunctionCallItem,
    MessageItem,
    ReasoningItem,
    ResponsesRequest,
    TextContent,
    items_to_messages,
    pack_thinking,
)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    """One response: its object (`snapshot()`), and the events that build it."""

    def __init__(self, req: ResponsesRequest, model: str, response_id: str | None = None) -> None:
        self.req = req
        self.id = response_id or new_id("resp")
        self.created_at = int(time.time())
        self.model = model
        self.status = "queued" if req.background else "in_progress"
        self.items: list[dict] = []  # the output items, complete or growing
        self._item_of: dict[int, dict] = {}  # part index -> its item
        self.usage: dict | None = None
        self.incomplete_reason: str | None = None
        self.error: dict | None = None
        self.sequence = 0
        self.pending_logprobs: list[dict] = []  # the text's logprobs not yet sent with a delta

    # -- the object -----------------------------------------------------------------------
    def snapshot(self) -> dict:
        req = self.req
        text_format = (
            req.text.format.model_dump(by_alias=True, exclude_none=True)
            if req.text is not None and req.text.format is not None
            else {"type": "text"}
        )
        reasoning = req.reasoning.model_dump(exclude_none=True) if req.reasoning else {}
        choice = req.tool_choice
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": self.status,
            "background": bool(req.background),
            "error": self.error,
            "incomplete_details": (
                None if self.incomplete_reason is None else {"reason": self.incomplete_reason}
            ),
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": None,
            "model": self.model,
            # Rendered at once (a reply) or deep-copied by `event`: the items themselves.
            "output": list(self.items),
            "parallel_tool_calls": bool(req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": reasoning.get("effort"),
                          "summary": reasoning.get("summary", reasoning.get("generate_summary"))},
            "service_tier": "default",
            "store": bool(req.store),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": text_format, "verbosity": "medium"},
            "tool_choice": (choice.model_dump() if hasattr(choice, "model_dump")
                            else choice or "auto"),  # fmt: skip
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "top_logprobs": req.top_logprobs or 0,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "truncation": req.truncation or "disabled",
            "usage": self.usage,
            "user": req.user,
            "metadata": req.metadata or {},
        }  # fmt: skip

    # -- events ---------------------------------------------------------------------------
    def event(self, type: str, **fields) -> dict:
        # The items and parts an event carries are as they are now: they grow afterwards.
        for key in ("item", "part", "response"):
            if key in fields:
                fields[key] = copy.deepcopy(fields[key])
        out = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return out

    def start(self) -> list[dict]:
        snapshot = self.snapshot()
        return [
            self.event("response.created", response=snapshot),
            self.event("response.in_progress", response=snapshot),
        ]

    def add_logprobs(self, entries: list[dict]) -> None:
        self.pending_logprobs.extend(entries)

    def apply(self, events: list[PartEvent]) -> list[dict]:
        """The stream events for the reply's part events (the items updated on the way)."""
        out: list[dict] = []
        for e in events:
            if e.kind == "open":
                out += self._open(e.part)
            elif e.kind == "delta":
                out += self._delta(e.part, e.piece)
            else:
                out += self._close(e.part)
        return out

    def _where(self, part: Part) -> dict:
        item = self._item_of[part.index]
        return {"item_id": item["id"], "output_index": self.items.index(item)}

    def _open(self, part: Part) -> list[dict]:
        if part.kind == REASONING:
            item = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
            if self.req.include and "reasoning.encrypted_content" in self.req.include:
                item["encrypted_content"] = None
        elif part.kind == TEXT:
            item = {"id": new_id("msg"), "type": "message", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
        else:
            item = {"id": new_id("fc"), "type": "function_call", "call_id": part.call_id,
                    "name": part.name, "arguments": "", "status": "in_progress"}  # fmt: skip
        self.items.append(item)
        self._item_of[part.index] = item
        out = [self.event("response.output_item.added", output_index=len(self.items) - 1,
                          item=dict(item))]  # fmt: skip
        if part.kind != CALL:
            content = self._content(part.kind, "")
            item["content"].append(content)
            out.append(self.event("response.content_part.added", **self._where(part),
                                  content_index=0, part=dict(content)))  # fmt: skip
        return out

    def _content(self, kind: str, text: str) -> dict:
        if kind == REASONING:
            return {"type": "reasoning_text", "text": text}
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _delta(self, part: Part, piece: str) -> list[dict]:
        item = self._item_of[part.index]
        where = self._where(part)
        if part.kind != TEXT:
            self.pending_logprobs = []  # the step's tokens were thinking or a call's
        if part.kind == CALL:
            item["arguments"] = part.text
            return [self.event("response.function_call_arguments.delta", **where, delta=piece)]
        item["content"][0]["text"] = part.text
        if part.kind == REASONING:
            return [self.event("response.reasoning_text.delta", **where, content_index=0,
                               delta=piece)]  # fmt: skip
        logprobs, self.pending_logprobs = self.pending_logprobs, []
        if self.req.logprobs_asked:
            item["content"][0]["logprobs"].extend(logprobs)
        return [self.event("response.output_text.delta", **where, content_index=0, delta=piece,
                           logprobs=logprobs)]  # fmt: skip

    def _close(self, part: Part) -> list[dict]:
        item = self._item_of[part.index]
        where = self._where(part)
        out = []
        if part.kind == CALL:
            item["arguments"] = part.text
            out.append(self.event("response.function_call_arguments.done", **where,
                                  name=part.name, arguments=part.text))  # fmt: skip
        else:
            content = item["content"][0]
            if part.kind == TEXT:
                if self.pending_logprobs and self.req.logprobs_asked:
                    content["logprobs"].extend(self.pending_logprobs)
                self.pending_logprobs = []
                out.append(self.event("response.output_text.done", **where, content_index=0,
                                      text=part.text, logprobs=content["logprobs"]))  # fmt: skip
            else:
                out.append(self.event("response.reasoning_text.done", **where, content_index=0,
                                      text=part.text))  # fmt: skip
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=dict(content)))  # fmt: skip
            if part.kind == REASONING:
                out += self._finish_reasoning(item, part, where)
        item["status"] = "completed"
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=dict(item)))  # fmt: skip
        return out

    def _finish_reasoning(self, item: dict, part: Part, where: dict) -> list[dict]:
        out = []
        if "encrypted_content" in item:
            item["encrypted_content"] = pack_thinking(part.text)
        if self.req.summary_asked:
            # quill has no summarizer: the summary asked for is the thinking itself.
            summary = {"type": "summary_text", "text": part.text}
            item["summary"] = [summary]
            empty = {"type": "summary_text", "text": ""}
            out += [
                self.event("response.reasoning_summary_part.added", **where, summary_index=0,
                           part=empty),
                self.event("response.reasoning_summary_text.delta", **where, summary_index=0,
                           delta=part.text),
                self.event("response.reasoning_summary_text.done", **where, summary_index=0,
                           text=part.text),
                self.event("response.reasoning_summary_part.done", **where, summary_index=0,
                           part=summary),
            ]  # fmt: skip
        return out

    def finish(self, finish_reason: str | None, usage: dict) -> dict:
        """The last event: completed, or incomplete when the reply ran out of tokens."""
        self.usage = usage
        if finish_reason == "length":
            self.status = "incomplete"
            self.incomplete_reason = "max_output_tokens"
            return self.event("response.incomplete", response=self.snapshot())
        self.status = "completed"
        return self.event("response.completed", response=self.snapshot())

    def fail(self, message: str, code: str = "server_error") -> list[dict]:
        self.status = "failed"
        self.error = {"code": code, "message": message}
        return [
            self.event("error", code=code, message=message, param=None),
            self.event("response.failed", response=self.snapshot()),
        ]

    def cancel(self) -> None:
        self.status = "cancelled"

    def conversation(self) -> list[dict]:
        """The output as chat messages, for a later turn that continues from this one."""
        items = []
        for item in self.items:
            if item["type"] == "reasoning":
                items.append(ReasoningItem(type="reasoning", content=item["content"]))
            else:
                items.append(_as_input(item))
        return items_to_messages(items)


def _as_input(item: dict):
    if item["type"] == "message":
        text = "".join(c["text"] for c in item["content"])
        return MessageItem(role="assistant", content=[TextContent(type="output_text", text=text)])
    return FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                            arguments=item["arguments"])  # fmt: skip
