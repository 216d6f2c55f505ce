"""Anthropic's Messages API: `POST /v1/messages` (whole or streamed) and
`POST /v1/messages/count_tokens`.

A request becomes a chat completions request (quill/server/messages/protocol.py) and runs as
one (`start_chat`: the chat format, limits, admission, metrics, cost, the console); its reply's
parts (quill/server/reply_parts.py) become content blocks (quill/server/messages/builder.py).
Errors come in Anthropic's shape (quill/server/errors.py), a stream's as an `error` event.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from quill.contract.errors import InvalidRequestError
from quill.server.chat import ChatRun, prepare, start_chat, translated
from quill.server.context import ServerContext
from quill.server.engine_client import EngineFailure
from quill.server.errors import anthropic_body, renamed
from quill.server.generation import RequestFailed, typed_sse, unless_disconnected
from quill.server.messages.builder import MessageBuilder, usage
from quill.server.messages.protocol import CHAT_PARAMS, CountTokensRequest, MessagesRequest
from quill.server.reply_parts import PartStream

log = logging.getLogger(__name__)


async def _drive(run: ChatRun, builder: MessageBuilder) -> AsyncIterator[dict]:
    parts = PartStream(run.readers[0])
    out = None
    async for _, out in run.gen.outputs():
        c = out.outputs[0]
        for event in builder.apply(parts.feed(c.delta_text, c.finished)):
            yield event
    c = out.outputs[0]
    u = run.gen.usage()
    final = usage(u["prompt_tokens"], u["prompt_tokens_details"]["cached_tokens"],
                  u["completion_tokens"])  # fmt: skip
    for event in builder.finish(c.finish_reason, c.stop_reason, bool(parts.calls), final):
        yield event


async def _event_stream(run: ChatRun, builder: MessageBuilder) -> AsyncIterator[str]:
    try:
        yield typed_sse(builder.start(len(run.prompt)))
        try:
            async for event in _drive(run, builder):
                yield typed_sse([event])
        except RequestFailed as e:
            yield typed_sse([anthropic_body(400, e.message)])
        except EngineFailure as e:
            yield typed_sse([anthropic_body(500, str(e))])
        except Exception:
            log.exception("message %s failed", builder.id)
            yield typed_sse([anthropic_body(500, "internal server error")])
    finally:
        run.gen.abort()


async def _collect(run: ChatRun, builder: MessageBuilder) -> dict:
    async for _ in _drive(run, builder):
        pass
    return builder.snapshot()


def install_messages(router: APIRouter, ctx: ServerContext, parse, arrival) -> None:
    """The Messages API's routes on `router` (/v1)."""

    @router.post("/messages")
    async def create(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, MessagesRequest)
        model = ctx.check_model(req.model)
        chat = translated(ctx, req.chat_request(), CHAT_PARAMS)
        try:
            run = await start_chat(ctx, chat, request, t, prefix="msg")
        except InvalidRequestError as e:
            raise renamed(e, CHAT_PARAMS) from None
        builder = MessageBuilder(model)
        if req.stream:
            return StreamingResponse(_event_stream(run, builder), media_type="text/event-stream")
        builder.start(len(run.prompt))
        reply = await unless_disconnected(request, run.gen, lambda: _collect(run, builder))
        return reply if isinstance(reply, Response) else JSONResponse(reply)

    @router.post("/messages/count_tokens")
    async def count_tokens(request: Request) -> dict:
        req = await parse(request, CountTokensRequest)
        ctx.check_model(req.model)
        chat = translated(ctx, req.chat_request(), CHAT_PARAMS)
        try:
            turn = await asyncio.to_thread(prepare, ctx, chat)
        except InvalidRequestError as e:
            raise renamed(e, CHAT_PARAMS) from None
        return {"input_tokens": len(turn.prompt_ids)}
