"""Tool calling over the chat API: OpenAI's `tools` and `tool_choice` read into the generic
format's functions and choice (a 400 naming the field for anything wrong), and each choice's
reply turned back into `message.tool_calls` or into the stream's deltas.

The stream and the whole reply are built by one `ToolCalls` reading the same text, so a
client that joins the deltas (id and name once per call, then argument fragments keyed by
`index`) gets exactly the calls the non-streamed reply has.
"""

from __future__ import annotations

import uuid

from quill.contract.errors import InvalidRequestError
from quill.frontend.tools import NAME, Function, ToolChoice, ToolReply


def read_tools(
    tools: list[dict] | None, tool_choice: str | dict | None, parallel: bool | None
) -> tuple[list[Function], ToolChoice | None]:
    """The functions offered and how the reply must use them (None: tools are not used, as
    with tool_choice "none"). `tools` as the request gave them (each {"type", "function"})."""
    if tools is not None and not tools:
        raise InvalidRequestError("tools must not be empty (leave it out instead)", "tools")
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError(
                "tool_choice is only allowed when tools are specified", "tool_choice"
            )
        return [], None
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: function names must be unique", "tools")
    # One call a reply unless parallel_tool_calls asks for more (llama-server's default, not
    # OpenAI's): a small model asked for "one or more" calls tends to repeat its call until
    # max_tokens, and the reply then neither ends nor parses.
    parallel = parallel is True
    if tool_choice in (None, "auto", "required"):
        return functions, ToolChoice(tool_choice or "auto", parallel=parallel)
    if tool_choice == "none":
        return functions, None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        if name not in names:
            raise InvalidRequestError(
                f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
            )
        return functions, ToolChoice("named", name, parallel=False)
    raise InvalidRequestError(
        'tool_choice must be "none", "auto", "required" or '
        '{"type": "function", "function": {"name": ...}}',
        "tool_choice",
    )


def _function(tool: dict, index: int) -> Function:
    where = f"tools.{index}"
    if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise InvalidRequestError(f'{where}: a tool must be {{"type": "function", '
                                  '"function": {...}}', "tools")  # fmt: skip
    fn = tool["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise InvalidRequestError(
            f"{where}.function.name must be 1-64 letters, digits, _ or -", "tools"
        )
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise InvalidRequestError(f"{where}.function.description must be a string", "tools")
    parameters = fn.get("parameters")
    if parameters is not None and (
        not isinstance(parameters, dict) or parameters.get("type", "object") != "object"
    ):
        raise InvalidRequestError(
            f"{where}.function.parameters must be a JSON schema of an object", "tools"
        )
    return Function(name, description, parameters)


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
