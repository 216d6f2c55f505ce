"""The Responses API without a server: the event stream a reply's parts make
(quill/server/reply_parts.py's PartStream into quill/server/responses/builder.py's
ResponseBuilder) and the store of responses (quill/server/responses/store.py).

The property: for any reply in the Qwen3 formats (a `<think>` block, text, hermes
`<tool_call>` blocks), read in pieces split anywhere, the events follow the stream's grammar
item by item, their sequence numbers count up from 0, their deltas join into what the done
events and the final object say, and the items equal those of the same reply read at once
(and agree with the chat completions message the same reply makes).
"""

from __future__ import annotations

import json
import re

from hypothesis import given, settings
from hypothesis import strategies as st

from quill.frontend.reasoning import REASONING_FORMATS
from quill.frontend.tool_formats import FORMATS
from quill.frontend.tools import ToolChoice
from quill.server.reply_parts import PartStream
from quill.server.responses.builder import ResponseBuilder
from quill.server.responses.protocol import ResponsesRequest, unpack_thinking
from quill.server.responses.store import ResponseStore, StoredResponse
from quill.server.tools import ReplyReader

USAGE = {"input_tokens": 1, "output_tokens": 1, "total_tokens": 2}

# Each item's events, by the item's type (a summary's four events only when one was asked).
_ITEM_GRAMMAR = {
    "message": re.compile(
        r"added part_added (output_text\.delta )+output_text\.done part_done done"
    ),
    "reasoning": re.compile(
        r"added part_added (reasoning_text\.delta )+reasoning_text\.done part_done "
        r"(summary_part_added summary_delta summary_done summary_part_done )?done"
    ),
    "function_call": re.compile(
        r"added (function_call_arguments\.delta )*function_call_arguments\.done done"
    ),
}
_SHORT = {
    "response.output_item.added": "added",
    "response.output_item.done": "done",
    "response.content_part.added": "part_added",
    "response.content_part.done": "part_done",
    "response.reasoning_summary_part.added": "summary_part_added",
    "response.reasoning_summary_text.delta": "summary_delta",
    "response.reasoning_summary_text.done": "summary_done",
    "response.reasoning_summary_part.done": "summary_part_done",
}


def _short(event_type: str) -> str:
    return _SHORT.get(event_type, event_type.removeprefix("response."))


def check_events(events: list[dict]) -> list[dict]:
    """Check a whole stream of Responses events (dicts as on the wire) against the stream's
    grammar; returns the output items as the output_item.done events gave them."""
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert all(t not in ("response.created", "response.in_progress") for t in types[2:])
    response_id = events[0]["response"]["id"]
    assert all(e["response"]["id"] == response_id for e in (events[1], events[-1]))
    body, items, i = events[2:-1], [], 0
    while i < len(body):
        added = body[i]
        assert added["type"] == "response.output_item.added", added
        assert added["output_index"] == len(items)
        item = added["item"]
        assert item["status"] == "in_progress"
        # The item as it began: its content comes in the events after (OpenAI's shape).
        begun = {"arguments": ""} if item["type"] == "function_call" else {"content": []}
        assert {k: item[k] for k in begun} == begun, ("output_item.added", item)
        j = i + 1
        while body[j]["type"] != "response.output_item.done":
            j += 1  # an item's events are contiguous: nothing of another item in between
        own = body[i : j + 1]
        shape = " ".join(_short(e["type"]) for e in own)
        assert _ITEM_GRAMMAR[item["type"]].fullmatch(shape), (item["type"], shape)
        for e in own:
            assert e["output_index"] == len(items)
            if "item_id" in e:
                assert e["item_id"] == item["id"]
            if "content_index" in e:
                assert e["content_index"] == 0
        done = own[-1]["item"]
        assert done["id"] == item["id"] and done["type"] == item["type"]
        assert done["status"] == "completed"
        deltas = "".join(e["delta"] for e in own if e["type"].endswith("text.delta")
                         and "summary" not in e["type"])  # fmt: skip
        arguments = "".join(e["delta"] for e in own if e["type"].endswith("arguments.delta"))
        if item["type"] == "function_call":
            assert own[-2]["arguments"] == arguments == done["arguments"]
            assert own[-2]["name"] == done["name"] == item["name"]
            assert done["call_id"] == item["call_id"]
        else:
            text_done = next(e for e in own if e["type"].endswith("_text.done")
                             and "summary" not in e["type"])  # fmt: skip
            assert text_done["text"] == deltas == done["content"][0]["text"]
            part_done = next(e for e in own if e["type"] == "response.content_part.done")
            assert part_done["part"] == done["content"][0]
            assert len(done["content"]) == 1
        items.append(done)
        i = j + 1
    assert events[-1]["response"]["output"] == items
    return items


# -- a reply in the Qwen3 formats, built from pieces ------------------------------------
_WORDS = st.text(alphabet='ab xyz.,!\n{}"<>/é', min_size=1, max_size=12)
_NAMES = st.sampled_from(["get_weather", "search", "f"])
_VALUES = st.one_of(st.integers(-1000, 1000), st.booleans(), st.none(),
                    st.text(alphabet="ab \"\\\n{}<>é", max_size=6),
                    st.lists(st.integers(0, 9), max_size=3))  # fmt: skip
_ARGUMENTS = st.dictionaries(st.text(alphabet="abc_", min_size=1, max_size=4), _VALUES,
                             max_size=3)  # fmt: skip


@st.composite
def _calls(draw) -> str:
    name, arguments = draw(_NAMES), draw(_ARGUMENTS)
    body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=draw(st.booleans()))
    return f"<tool_call>\n{body}\n</tool_call>"


@st.composite
def replies(draw, text_after_calls: bool = True) -> str:
    """A reply: maybe thinking, then text and calls; `text_after_calls` False keeps all text
    before the first call (as a model that stops after calling writes)."""
    out = ""
    if draw(st.booleans()):
        out += "<think>" + draw(st.sampled_from(["", "\n"])) + draw(_WORDS) + "</think>\n\n"
    pieces = draw(st.lists(st.one_of(_WORDS, _calls()), max_size=5))
    if not text_after_calls:
        pieces = sorted(pieces, key=lambda p: p.startswith("<tool_call>"))
    return out + "\n".join(pieces)


def _reader() -> ReplyReader:
    return ReplyReader(ToolChoice("auto"), FORMATS["hermes"], REASONING_FORMATS["qwen3"], False)


def build(pieces: list[str], request: dict | None = None) -> tuple[list[dict], list[dict]]:
    """The events and items that the reply's `pieces`, read in turn, make."""
    req = ResponsesRequest.model_validate(request or {"input": "x"})
    builder, parts = ResponseBuilder(req, "m"), PartStream(_reader())
    events = builder.start()
    for n, piece in enumerate(pieces):
        events += builder.apply(parts.feed(piece, n == len(pieces) - 1))
    events.append(builder.finish("stop", USAGE))
    return events, builder.items


def _split(text: str, cuts: list[int], empty_end: bool) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    pieces = [text[a:b] for a, b in zip(points, points[1:])] or [""]
    return pieces + [""] if empty_end else pieces


def _without_ids(items: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]


def _as_chat(items: list[dict]) -> dict:
    """What the chat completions message of the same reply holds, from the items."""
    texts = ["".join(c["text"] for c in i["content"]) for i in items if i["type"] == "message"]
    thinking = [i["content"][0]["text"] for i in items if i["type"] == "reasoning"]
    calls = [(i["name"], i["arguments"]) for i in items if i["type"] == "function_call"]
    return {"content": "".join(texts), "reasoning": "".join(thinking) or None, "calls": calls}


def _chat_message(text: str) -> dict:
    message = _reader().message(text)
    calls = [(c["function"]["name"], c["function"]["arguments"])
             for c in message.get("tool_calls", [])]  # fmt: skip
    return {"content": message["content"] or "", "reasoning": message["reasoning_content"],
            "calls": calls}  # fmt: skip


def _check_reply(text: str, cuts: list[int], empty_end: bool) -> None:
    whole_events, whole_items = build([text])
    split_events, split_items = build(_split(text, cuts, empty_end))
    assert check_events(whole_events) == whole_items
    assert check_events(split_events) == split_items
    assert _without_ids(split_items) == _without_ids(whole_items), text
    assert _as_chat(split_items) == _chat_message(text)


@settings(max_examples=300, deadline=None)
@given(replies(text_after_calls=False), st.lists(st.integers(0, 10_000), max_size=20),
       st.booleans())  # fmt: skip
def test_a_reply_split_anywhere_builds_the_items_of_the_whole_reply(text, cuts, empty_end):
    _check_reply(text, cuts, empty_end)


@settings(max_examples=300, deadline=None)
@given(replies(text_after_calls=True), st.lists(st.integers(0, 10_000), max_size=20),
       st.booleans())  # fmt: skip
def test_text_after_a_call_builds_the_same_items_split_or_whole(text, cuts, empty_end):
    _check_reply(text, cuts, empty_end)


def test_text_after_a_call_in_one_piece_with_the_calls_end():
    # The engine may hand over several tokens at once (a stop string forming, UTF-8 held
    # back): the call's last arguments and the text after it then arrive in one delta.
    call = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    text = call + "\nDone."
    pieces = [call[:-30], call[-30:] + "\nDone."]
    events, items = build(pieces)
    check_events(events)
    assert [i["type"] for i in items] == ["function_call", "message"]
    assert json.loads(items[0]["arguments"]) == {"a": 1}
    assert _without_ids(items) == _without_ids(build([text])[1])


def test_output_item_added_carries_the_item_as_it_began():
    # One piece opens the item and grows it: the added event must still show it empty (a
    # client appends the content_part.added part and the deltas to what it showed).
    events, items = build(["<think>hmm</think>Hello"])
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["type"] for a in added] == ["reasoning", "message"]
    assert [a["content"] for a in added] == [[], []]
    assert items[1]["content"][0]["text"] == "Hello"


def test_the_reasoning_items_of_a_reply():
    text = "<think>\nweigh it</think>\n\nIt is <tool_call>\n" \
        '{"name": "f", "arguments": {"a": [1, 2]}}\n</tool_call>'  # fmt: skip
    request = {"input": "x", "include": ["reasoning.encrypted_content"],
               "reasoning": {"summary": "auto"}}  # fmt: skip
    events, items = build([text[:9], text[9:20], text[20:]], request)
    check_events(events)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    reasoning = items[0]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "weigh it"}]
    assert unpack_thinking(reasoning["encrypted_content"]) == "weigh it"
    assert reasoning["summary"] == [{"type": "summary_text", "text": "weigh it"}]
    assert items[1]["content"][0]["text"] == "It is"
    assert items[2]["name"] == "f" and json.loads(items[2]["arguments"]) == {"a": [1, 2]}
    # Without the asks: no encrypted_content, no summary events.
    events, items = build([text])
    assert "encrypted_content" not in items[0] and items[0]["summary"] == []
    assert not any("summary" in e["type"] for e in events)


def test_a_reply_cut_by_max_output_tokens_is_incomplete():
    req = ResponsesRequest.model_validate({"input": "x", "max_output_tokens": 3})
    builder, parts = ResponseBuilder(req, "m"), PartStream(_reader())
    events = builder.start() + builder.apply(parts.feed("<think>abc", True))
    events.append(builder.finish("length", USAGE))
    check_events(events)
    last = events[-1]["response"]
    assert last["status"] == "incomplete"
    assert last["incomplete_details"] == {"reason": "max_output_tokens"}
    assert last["output"][0]["content"][0]["text"] == "abc"


# -- the store ----------------------------------------------------------------------------
class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _stored(status: str = "completed", text: str = "hi") -> StoredResponse:
    builder = ResponseBuilder(ResponsesRequest.model_validate({"input": text}), "m")
    builder.status = status
    return StoredResponse(builder, [{"role": "user", "content": text}])


def _put(store: ResponseStore, stored: StoredResponse) -> str:
    store.put(stored, stored.history)
    return stored.builder.id


def test_a_stored_response_expires_after_ttl():
    clock = _Clock()
    store = ResponseStore(max_bytes=1 << 20, ttl_s=60.0, clock=clock)
    first = _put(store, _stored())
    clock.now += 30
    second = _put(store, _stored())
    clock.now += 29
    assert store.get(first) is not None and store.get(second) is not None
    clock.now += 2  # first: 61 s old, second: 31 s
    assert store.get(first) is None
    assert store.get(second) is not None
    clock.now += 30
    assert store.get(second) is None
    assert not store.entries and store.bytes_used == 0


def test_a_running_response_outlives_its_ttl_and_expires_once_done():
    clock = _Clock()
    store = ResponseStore(max_bytes=1 << 20, ttl_s=10.0, clock=clock)
    running = _stored("in_progress")
    rid = _put(store, running)
    clock.now += 100
    assert store.get(rid) is running
    running.builder.status = "completed"
    running.finished()
    assert store.get(rid) is None


def test_past_the_size_limit_the_oldest_go_first():
    clock = _Clock()
    one = _stored()
    size = len(json.dumps(one.history, separators=(",", ":"))) + 512
    store = ResponseStore(max_bytes=3 * size, ttl_s=1e9, clock=clock)
    ids = []
    for _ in range(3):
        ids.append(_put(store, _stored()))
        clock.now += 1
    assert list(store.entries) == ids and store.bytes_used == 3 * size
    ids.append(_put(store, _stored()))
    assert list(store.entries) == ids[1:]
    ids.append(_put(store, _stored()))
    assert list(store.entries) == ids[2:]
    assert store.bytes_used <= store.max_bytes


def test_a_running_response_is_never_evicted_for_size():
    clock = _Clock()
    one = _stored()
    size = len(json.dumps(one.history, separators=(",", ":"))) + 512
    store = ResponseStore(max_bytes=2 * size, ttl_s=1e9, clock=clock)
    running = _put(store, _stored("in_progress"))
    done = _put(store, _stored())
    newest = _put(store, _stored())
    # Over the limit: the oldest that is not running goes, the running one stays.
    assert list(store.entries) == [running, newest] and done not in store.entries
    for _ in range(3):
        _put(store, _stored())
    assert running in store.entries
    assert store.get(running) is not None


def test_a_finished_response_counts_its_output_and_carries_the_conversation():
    store = ResponseStore(max_bytes=1 << 20, ttl_s=1e9, clock=_Clock())
    stored = _stored("in_progress", text="q")
    builder = stored.builder
    rid = _put(store, stored)
    before = store.bytes_used
    parts = PartStream(_reader())
    builder.apply(parts.feed('<think>t</think>A<tool_call>{"name": "f", "arguments": {}}'
                             "</tool_call>", True))  # fmt: skip
    builder.finish("stop", USAGE)
    stored.finished()
    assert store.bytes_used > before
    conversation = store.get(rid).conversation()
    assert conversation[0] == {"role": "user", "content": "q"}
    (assistant,) = conversation[1:]
    assert assistant["role"] == "assistant" and assistant["content"] == "A"
    assert assistant["reasoning_content"] == "t"
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["f"]
    assert assistant["tool_calls"][0]["id"] == builder.items[2]["call_id"]
