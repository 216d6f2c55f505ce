"""Tool calls in the chat API's replies: each choice's reply, in the generic tool format
(quill/frontend/tools.py), turned into `message.tool_calls` or into the stream's deltas.

The stream and the whole reply are built by one `ToolCalls` reading the same text, so a
client that joins the deltas (id and name once per call, then argument fragments keyed by
`index`) gets exactly the calls the non-streamed reply has.
"""

from __future__ import annotations

import uuid

from quill.frontend.tools import ToolChoice, ToolReply


class ToolCalls:
    """One choice's reply under a tool choice, read as it arrives."""

    def __init__(self, choice: ToolChoice) -> None:
        self.choice = choice
        self.reply = ToolReply()
        self.ids: list[str] = []
        self._sent_content = 0
        self._sent_arguments: list[int] = []

    def delta(self, text: str, finished: bool) -> dict:
        """The stream delta for `text`, the reply's next piece (empty: nothing to send yet)."""
        self.reply.feed(text)
        if finished:
            self.reply.finish()
        delta: dict = {}
        content = self.reply.content()
        if finished and content is None and not self.reply.is_call:
            content = self.reply.unread()  # cut short before its shape was known
        if content is not None and len(content) > self._sent_content:
            delta["content"] = content[self._sent_content :]
            self._sent_content = len(content)
        calls = []
        for index, (name, arguments) in enumerate(self.reply.calls()):
            if name is None:
                break
            entry: dict = {"index": index}
            if index == len(self.ids):  # a new call: its id and name, once
                self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
                self._sent_arguments.append(0)
                entry |= {"id": self.ids[index], "type": "function",
                          "function": {"name": name, "arguments": ""}}  # fmt: skip
            fragment = arguments[self._sent_arguments[index] :]
            if fragment:
                entry.setdefault("function", {})["arguments"] = fragment
                self._sent_arguments[index] = len(arguments)
            if len(entry) > 1:
                calls.append(entry)
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self, text: str) -> dict:
        """The whole reply as a chat.completion message (read as the stream reads it)."""
        delta = self.delta(text, finished=True)
        message: dict = {"role": "assistant", "content": delta.get("content")}
        if self.reply.is_call:
            message["content"] = None
            message["tool_calls"] = [
                {
                    "id": self.ids[i],
                    "type": "function",
                    "function": {"name": name, "arguments": arguments},
                }  # fmt: skip
                for i, (name, arguments) in enumerate(self.reply.calls())
                if name is not None
            ]
        elif message["content"] is None:
            message["content"] = ""
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named
        function's call ends with "stop"."""
        if reason == "stop" and self.reply.is_call and self.choice.mode != "named":
            return "tool_calls"
        return reason
