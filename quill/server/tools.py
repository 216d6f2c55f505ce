"""A chat reply as the API returns it: the thinking split off into `reasoning_content` (and
`reasoning`), tool calls in the model's format (quill/frontend/tool_formats.py) turned into
`message.tool_calls`, the rest as `content`; whole, or as the stream's deltas.

The stream and the whole reply are built by one `ReplyReader` reading the same text, so a
client that joins the deltas (reasoning and content pieces; a call's id and name once, then
argument fragments keyed by `index`) gets exactly the non-streamed message.
"""

from __future__ import annotations

from quill.frontend.reasoning import ReasoningFormat
from quill.frontend.tool_formats import FORMATS, ToolFormat
from quill.frontend.tools import ToolChoice


class ReplyReader:
    """One choice's reply, read as it arrives."""

    def __init__(
        self,
        choice: ToolChoice | None,
        fmt: ToolFormat = FORMATS["generic"],
        reasoning: ReasoningFormat | None = None,
        opened: bool = False,
        include_reasoning: bool = True,
    ) -> None:
        """`choice`: how the reply uses tools (None: it is text); `reasoning`: the format its
        thinking is in (None: no thinking), `opened` when the prompt opened the block."""
        self.choice = choice
        self.calls = None if choice is None else fmt.reader()
        self.format = fmt
        self.split = None if reasoning is None else reasoning.splitter(opened)
        self.include_reasoning = include_reasoning
        self.answer = ""  # the answer's text so far (outside the thinking)
        self.ids: list[str] = []
        self._sent_reasoning = 0
        self._sent_content = 0
        self._sent_arguments: list[int] = []

    def delta(self, text: str, finished: bool) -> dict:
        """The stream delta for `text`, the reply's next piece (empty: nothing to send yet)."""
        delta: dict = {}
        piece = text
        if self.split is not None:
            self.split.feed(text)
            if finished:
                self.split.finish()
            reasoning = self.split.reasoning()
            if len(reasoning) > self._sent_reasoning and self.include_reasoning:
                new = reasoning[self._sent_reasoning :]
                delta |= {"reasoning_content": new, "reasoning": new}
                self._sent_reasoning = len(reasoning)
            answer = self.split.content()
            piece = answer[len(self.answer) :]
        self.answer += piece
        if self.calls is None:
            content = self.answer
        else:
            self.calls.feed(piece)
            if finished:
                self.calls.finish()
            content = self.calls.content() or ""
        if len(content) > self._sent_content:
            delta["content"] = content[self._sent_content :]
            self._sent_content = len(content)
        if self.calls is not None:
            tool_calls = self._call_deltas()
            if tool_calls:
                delta["tool_calls"] = tool_calls
        return delta

    def _call_deltas(self) -> list[dict]:
        out = []
        for index, (name, arguments) in enumerate(self.calls.calls()):
            if name is None:
                break
            entry: dict = {"index": index}
            if index == len(self.ids):  # a new call: its id and name, once
                self.ids.append(self.format.call_id())
                self._sent_arguments.append(0)
                entry |= {"id": self.ids[index], "type": "function",
                          "function": {"name": name, "arguments": ""}}  # fmt: skip
            fragment = arguments[self._sent_arguments[index] :]
            if fragment:
                entry.setdefault("function", {})["arguments"] = fragment
                self._sent_arguments[index] = len(arguments)
            if len(entry) > 1:
                out.append(entry)
        return out

    def message(self, text: str) -> dict:
        """The whole reply as a chat.completion message (read as the stream reads it)."""
        self.delta(text, finished=True)
        if self.calls is None:
            message: dict = {"role": "assistant", "content": self.answer}
        else:
            message = {"role": "assistant", "content": self.calls.content()}
            if self.calls.is_call:
                message["tool_calls"] = [
                    {
                        "id": self.ids[i],
                        "type": "function",
                        "function": {"name": name, "arguments": arguments},
                    }  # fmt: skip
                    for i, (name, arguments) in enumerate(self.calls.calls())
                    if name is not None
                ]
            elif message["content"] is None:
                message["content"] = ""
        if self.split is not None and self.include_reasoning:
            reasoning = self.split.reasoning() or None
            message |= {"reasoning_content": reasoning, "reasoning": reasoning}
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named
        function's call ends with "stop"."""
        if (
            reason == "stop"
            and self.calls is not None
            and self.calls.is_call
            and self.choice.mode != "named"
        ):
            return "tool_calls"
        return reason
