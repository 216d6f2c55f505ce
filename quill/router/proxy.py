"""One request through the router: whole to one instance, or split into prefill and decode.

Split: the prefill instance computes the prompt and the first token and keeps the prompt's KV
under a lease (`kv_transfer_params.do_remote_decode`); its reply says where the KV is; the
decode instance is sent the same request with those params, fetches the KV and writes the rest
of the reply. A streamed reply starts with the prefill instance's first token as soon as it
has it; the decode instance's stream repeats that token's text, so as much text is cut from
its start. The router's request id goes to both instances as X-Request-Id, which they echo and
log (each instance's engine names the request its own way: a client's id never addresses a
request).

What the split cannot carry goes whole to one instance (a decode instance can do both phases):
several prompts or choices, echo, logprobs (the decode instance has no logprobs for a token it
did not sample), prompt logprobs and max_tokens 0 (scoring a prompt is a prefill), tool calls
(a stream's first token is the start of the call's JSON, which only the instance that writes
the whole reply can read as a call).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

import httpx
from starlette.responses import JSONResponse, Response, StreamingResponse

from quill.router.instances import DECODE, PREFILL, WHOLE, Instance, Instances
from quill.router.policies import CacheAware, LeastLoad
from quill.router.prompt_blocks import PromptBlocks

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
_REPLACEMENT = "\ufffd"  # a token that ends inside a character: its text is not final


def splittable(path: str, body: dict) -> bool:
    """Whether the split can carry this request (else it goes whole to one instance)."""
    if body.get("n") not in (None, 1) or body.get("echo") or body.get("logprobs"):
        return False
    # prompt_logprobs 0 asks for something too (each prompt token's own logprob).
    if body.get("top_logprobs") or body.get("prompt_logprobs") is not None:
        return False
    if body.get("tools") and body.get("tool_choice") != "none":
        return False
    limit = body.get("max_completion_tokens")
    if limit is None:
        limit = body.get("max_tokens")
    if limit in (0, 1):
        return False  # the prefill instance's reply is the whole reply (0: the prompt alone)
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            return len(prompt) == 1
    return True


def error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": None, "code": None}}
    return JSONResponse(body, status_code=status)


class InstanceDown(Exception):
    """The instance a request was sent to went down while it was in flight."""


class Router:
    def __init__(
        self,
        instances: Instances,
        client: httpx.AsyncClient,
        metrics,
        policy=None,
        prompt_blocks: PromptBlocks | None = None,
    ) -> None:
        """`policy` picks among whole instances (quill/router/policies.py; least-load if
        None); `prompt_blocks` gives a request's blocks for the cache-aware policy."""
        self.instances = instances
        self.client = client
        self.metrics = metrics
        self.policy = policy or LeastLoad()
        self.prompt_blocks = prompt_blocks

    async def handle(self, path: str, body: dict, headers: dict) -> Response:
        prefix = "chatcmpl" if path == CHAT else "cmpl"
        request_id = headers.get("X-Request-Id") or f"{prefix}-{uuid.uuid4().hex}"
        headers = {**headers, "X-Request-Id": request_id}
        whole = self.instances.of(WHOLE)
        if whole or not splittable(path, body) or not self.instances.of(PREFILL):
            kind = WHOLE if whole else DECODE
            instance = await self.choose(kind, path, body)
            self.metrics.requests.labels(route="whole").inc()

            async def elsewhere() -> Instance | None:
                """Another instance, for a request whose instance refused the connection
                (nothing was sent: it is safe to send again)."""
                if not any(i.healthy for i in self.instances.of(kind)):
                    return None
                return await self.choose(kind, path, body)

            response = await self._forward(instance, path, body, headers, elsewhere)
        else:
            self.metrics.requests.labels(route="split").inc()
            response = await self._split(path, body, headers)
        response.headers["X-Request-Id"] = request_id
        return response

    async def choose(self, kind: str, path: str, body: dict) -> Instance:
        """The policy's pick among the instances of `kind` in the rotation; the request is
        counted on it at once, and its blocks expected there (quill/router/kv_index.py)."""
        candidates = self.instances.up(kind)
        hashes: list[bytes] = []
        if self.prompt_blocks is not None and isinstance(self.policy, CacheAware):
            size = candidates[0].block_size
            hashes = await asyncio.to_thread(self.prompt_blocks.hashes, path, body, size)
        now = time.monotonic()
        chosen = self.policy.choose(candidates, hashes, now)
        chosen.num_sent += 1
        if hashes:
            chosen.blocks.expect(hashes, now)
        reason = getattr(self.policy, "last_reason", self.policy.name)
        self.metrics.routed.labels(instance=chosen.url, reason=reason).inc()
        return chosen

    async def _forward(self, instance: Instance, path: str, body: dict, headers: dict, elsewhere):
        if body.get("stream"):
            return StreamingResponse(
                self._relay(instance, path, body, headers, skip=0, elsewhere=elsewhere),
                media_type="text/event-stream",
            )
        return await self._post(instance, path, body, headers, elsewhere)

    async def _post(
        self, instance: Instance, path: str, body: dict, headers: dict, elsewhere=None
    ) -> Response:
        while True:
            instance.num_in_flight += 1
            try:
                post = self.client.post(instance.url + path, json=body, headers=headers)
                r = await unless_down(instance, post)
            except httpx.ConnectError as e:
                self.instances.mark_down(instance, e)
                retry = await elsewhere() if elsewhere is not None else None
                if retry is None:
                    return self._failed(instance, e)
                instance = retry
                continue
            except (httpx.HTTPError, InstanceDown) as e:
                return self._failed(instance, e)
            finally:
                instance.num_in_flight -= 1
            return Response(r.content, r.status_code, media_type="application/json")

    def _failed(self, instance: Instance, e: Exception) -> JSONResponse:
        self.metrics.failures.labels(kind=instance.kind).inc()
        return error(503, f"the {instance.kind} instance {instance.url} failed: {e}")

    async def _split(self, path: str, body: dict, headers: dict) -> Response:
        prefill = self.instances.pick(PREFILL)
        asked = {**body, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        asked.pop("stream_options", None)
        first = await self._post(prefill, path, asked, headers)
        if first.status_code != 200:
            return first  # the prefill instance's error (a 400 for bad input, a 503 ...)
        first_reply = json.loads(first.body)
        params = first_reply.pop("kv_transfer_params", None)
        if params is None:  # the reply ended at its first token: it is the whole reply
            if body.get("stream"):
                return StreamingResponse(_as_stream(path, first_reply), "text/event-stream")
            return JSONResponse(first_reply)
        decode = self.instances.pick(DECODE)
        rest = {**body, "kv_transfer_params": {"do_remote_prefill": True, **params}}
        if body.get("stream"):
            return StreamingResponse(
                self._stream(path, first_reply, decode, rest, headers),
                media_type="text/event-stream",
            )
        reply = await self._post(decode, path, rest, headers)
        if reply.status_code != 200:
            return reply
        whole = json.loads(reply.body)
        whole["prefill_metrics"] = first_reply.get("metrics")
        return JSONResponse(whole)

    async def _stream(
        self, path: str, first_reply: dict, decode: Instance, body: dict, headers: dict
    ) -> AsyncIterator[str]:
        text = _text(path, first_reply["choices"][0])
        if text.endswith(_REPLACEMENT):
            text = ""  # wait for the decode instance's text of it
        stops = body.get("stop") or []
        # The end of it may begin a stop string that the next tokens complete: the decode
        # instance (which sees them) passes those characters on, or cuts the reply there.
        text = text[: len(text) - _held(text, [stops] if isinstance(stops, str) else stops)]
        yield _sse(_first_chunk(path, first_reply, text))
        async for chunk in self._relay(decode, path, body, headers, skip=len(text)):
            yield chunk

    async def _relay(
        self, instance: Instance, path: str, body: dict, headers: dict, skip: int, elsewhere=None
    ) -> AsyncIterator[str]:
        """An instance's stream, passed on but for its first `skip` characters of text (sent
        to `elsewhere()`'s instance instead if this one refuses the connection)."""
        instance.num_in_flight += 1
        retry = None
        try:
            async with self.client.stream(
                "POST", instance.url + path, json=body, headers=headers
            ) as r:
                if r.status_code != 200:
                    content = await r.aread()
                    yield _sse(_error_payload(r.status_code, content))
                    yield "data: [DONE]\n\n"
                    return
                async for line in _lines_unless_down(instance, r):
                    if not line.startswith("data: "):
                        continue
                    data = line[6:]
                    if data == "[DONE]":
                        yield "data: [DONE]\n\n"
                        return
                    chunk = json.loads(data)
                    if skip and chunk.get("choices"):
                        skip = _cut(path, chunk["choices"][0], skip)
                        if _empty(path, chunk["choices"][0]) and "usage" not in chunk:
                            continue
                    yield _sse(chunk)
        except httpx.ConnectError as e:  # nothing was sent: another instance may take it
            self.instances.mark_down(instance, e)
            retry = await elsewhere() if elsewhere is not None else None
            if retry is None:
                yield self._stream_error(instance, e)
                yield "data: [DONE]\n\n"
        except (httpx.HTTPError, InstanceDown) as e:
            yield self._stream_error(instance, e)
            yield "data: [DONE]\n\n"
        finally:
            instance.num_in_flight -= 1
        if retry is not None:
            async for chunk in self._relay(retry, path, body, headers, skip, elsewhere):
                yield chunk

    def _stream_error(self, instance: Instance, e: Exception) -> str:
        self.metrics.failures.labels(kind=instance.kind).inc()
        message = f"the {instance.kind} instance {instance.url} failed: {e}"
        return _sse({"error": {"message": message, "type": "server_error"}})


async def unless_down(instance: Instance, awaitable):
    """`awaitable`'s result, or InstanceDown as soon as the instance is found down."""
    down = instance.down
    if down is None:
        return await awaitable
    if down.is_set():
        raise InstanceDown(f"{instance.url} is down")
    work = asyncio.ensure_future(awaitable)
    watch = asyncio.ensure_future(down.wait())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if not work.done():
        work.cancel()
        raise InstanceDown(f"{instance.url} went down while the request was in flight")
    return work.result()


async def _lines_unless_down(instance: Instance, response: httpx.Response):
    lines = response.aiter_lines()
    while True:
        try:
            yield await unless_down(instance, anext(lines))
        except StopAsyncIteration:
            return


def _held(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could be the start of a stop string."""
    held = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:k]):
                held = k
                break
    return held


def _text(path: str, choice: dict) -> str:
    if path == CHAT:
        return (choice.get("message") or choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""


def _cut(path: str, choice: dict, skip: int) -> int:
    """Drop up to `skip` characters from the start of a chunk's text; how many are left."""
    if path == CHAT:
        delta = choice.get("delta") or {}
        delta.pop("role", None)  # the router's first chunk had it
        content = delta.get("content") or ""
        cut = min(skip, len(content))
        if "content" in delta:
            delta["content"] = content[cut:]
    else:
        content = choice.get("text") or ""
        cut = min(skip, len(content))
        choice["text"] = content[cut:]
    return skip - cut


def _empty(path: str, choice: dict) -> bool:
    if choice.get("finish_reason") is not None or choice.get("logprobs") is not None:
        return False
    return not _text(path, choice)


def _first_chunk(path: str, reply: dict, text: str) -> dict:
    head = {"id": reply["id"], "created": reply["created"], "model": reply["model"]}
    if path == CHAT:
        delta = {"role": "assistant", "content": text}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**head, "object": "chat.completion.chunk", "choices": [choice]}
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": None}
    return {**head, "object": "text_completion", "choices": [choice | {"stop_reason": None}]}


async def _as_stream(path: str, reply: dict) -> AsyncIterator[str]:
    """A whole (non-streamed) reply of one choice as a stream."""
    c = reply["choices"][0]
    chunk = _first_chunk(path, reply, _text(path, c))
    chunk["choices"][0]["finish_reason"] = c.get("finish_reason")
    yield _sse(chunk)
    yield "data: [DONE]\n\n"


def _error_payload(status: int, content: bytes) -> dict:
    try:
        body = json.loads(content)
        if "error" in body:
            return body
    except ValueError:
        pass
    return {"error": {"message": f"HTTP {status}: {content[:200]!r}", "type": "server_error"}}


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"
