"""The Responses API: `POST /v1/responses` (whole, streamed, or in the background),
`GET` / `DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, and
`POST /v1/responses/input_tokens`.

A request becomes a chat completions request (quill/server/responses/protocol.py) and runs as
one (`start_chat`: the chat format, limits, admission, metrics, cost, the console); its reply's
parts (quill/server/reply_parts.py) become output items (quill/server/responses/builder.py).
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
from quill.server.errors import APIError, renamed
from quill.server.generation import RequestFailed, typed_sse, unless_disconnected
from quill.server.logprobs import token_logprobs
from quill.server.reply_parts import REASONING, PartStream
from quill.server.responses.builder import ResponseBuilder
from quill.server.responses.protocol import CHAT_PARAMS, ResponsesRequest
from quill.server.responses.store import ResponseStore, StoredResponse

log = logging.getLogger(__name__)


def _history(store: ResponseStore, req: ResponsesRequest) -> list[dict]:
    if req.previous_response_id is None:
        return []
    previous = store.get(req.previous_response_id)
    if previous is None:
        raise APIError(404, f"Previous response with id '{req.previous_response_id}' not found.",
                       param="previous_response_id")  # fmt: skip
    if previous.running:
        raise APIError(400, f"Previous response '{req.previous_response_id}' is still in "
                       "progress.", param="previous_response_id")  # fmt: skip
    return previous.conversation()


async def _start(ctx, chat, raw, arrival_time) -> ChatRun:
    try:
        return await start_chat(ctx, chat, raw, arrival_time, prefix="resp")
    except InvalidRequestError as e:
        raise renamed(e, CHAT_PARAMS) from None
    except APIError as e:
        raise (renamed(e, CHAT_PARAMS) if e.status_code < 500 else e) from None


async def _drive(ctx: ServerContext, run: ChatRun, builder: ResponseBuilder) -> AsyncIterator[dict]:
    """The response's events as the reply arrives, ending with completed or incomplete."""
    parts = PartStream(run.readers[0])
    top_n = builder.req.top_logprobs or 0
    finish_reason = None
    async for _, out in run.gen.outputs():
        c = out.outputs[0]
        if builder.req.logprobs_asked and c.delta_logprobs is not None:
            builder.add_logprobs(token_logprobs(ctx.tokenizer, c.delta_token_ids,
                                                c.delta_logprobs, top_n))  # fmt: skip
        for event in builder.apply(parts.feed(c.delta_text, c.finished)):
            yield event
        finish_reason = c.finish_reason
    yield builder.finish(finish_reason, _usage(ctx, run, parts))


def _usage(ctx: ServerContext, run: ChatRun, parts: PartStream) -> dict:
    usage = run.gen.usage()
    thinking = "".join(p.text for p in parts.parts if p.kind == REASONING)
    # The thinking's tokens, counted again from its text (the engine does not mark them).
    reasoning_tokens = len(ctx.tokenizer.encode(thinking, False)) if thinking else 0
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
                                 "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": min(reasoning_tokens,
                                                          usage["completion_tokens"])},
        "total_tokens": usage["total_tokens"],
    }  # fmt: skip


async def _event_stream(
    ctx, run: ChatRun, builder: ResponseBuilder, stored, store: ResponseStore
) -> AsyncIterator[str]:
    try:
        yield typed_sse(builder.start())
        try:
            async for event in _drive(ctx, run, builder):
                yield typed_sse([event])
        except RequestFailed as e:
            yield typed_sse(builder.fail(e.message, "invalid_request_error"))
        except EngineFailure as e:
            yield typed_sse(builder.fail(str(e)))
        except Exception:
            log.exception("response %s failed", builder.id)
            yield typed_sse(builder.fail("internal server error"))
        if stored is not None:
            stored.finished()
    finally:
        run.gen.abort()
        if stored is not None and stored.running:  # the client left halfway: not kept
            store.delete(builder.id)


async def _collect(ctx, run: ChatRun, builder: ResponseBuilder) -> dict:
    async for _ in _drive(ctx, run, builder):
        pass
    return builder.snapshot()


async def _background(ctx, run: ChatRun, builder: ResponseBuilder, stored: StoredResponse):
    builder.status = "in_progress"
    try:
        await _collect(ctx, run, builder)
        stored.finished()
    except asyncio.CancelledError:
        builder.cancel()
    except (RequestFailed, EngineFailure) as e:
        builder.fail(getattr(e, "message", str(e)))
    except Exception:
        log.exception("background response %s failed", builder.id)
        builder.fail("internal server error")
    finally:
        run.gen.abort()


def install_responses(router: APIRouter, ctx: ServerContext, parse, arrival, store) -> None:
    """The Responses API's routes on `router` (/v1); `parse` validates a body against a
    schema, `arrival` is a request's arrival time."""

    @router.post("/responses")
    async def create(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, ResponsesRequest)
        model = ctx.check_model(req.model)
        history = _history(store, req)
        chat = translated(ctx, req.chat_request(history), CHAT_PARAMS)
        builder = ResponseBuilder(req, model)
        run = await _start(ctx, chat, request, t)
        stored = None
        if req.store:
            stored = StoredResponse(builder, history + req.input_messages())
            store.put(stored, req.input_messages())
        if req.background:
            stored.task = asyncio.create_task(_background(ctx, run, builder, stored))
            return JSONResponse(builder.snapshot())
        if req.stream:
            events = _event_stream(ctx, run, builder, stored, store)
            return StreamingResponse(events, media_type="text/event-stream")
        try:
            reply = await unless_disconnected(request, run.gen,
                                              lambda: _collect(ctx, run, builder))  # fmt: skip
        except BaseException:
            store.delete(builder.id)  # failed: nothing to keep
            raise
        if isinstance(reply, Response):  # the client left: nothing to keep
            store.delete(builder.id)
            return reply
        if stored is not None:
            stored.finished()
        return JSONResponse(reply)

    @router.post("/responses/input_tokens")
    async def input_tokens(request: Request) -> dict:
        req = await parse(request, ResponsesRequest)
        ctx.check_model(req.model)
        chat = translated(ctx, req.chat_request(_history(store, req)), CHAT_PARAMS)
        try:
            turn = await asyncio.to_thread(prepare, ctx, chat)
        except InvalidRequestError as e:
            raise renamed(e, CHAT_PARAMS) from None
        return {"object": "response.input_tokens", "input_tokens": len(turn.prompt_ids)}

    def stored_or_404(response_id: str) -> StoredResponse:
        stored = store.get(response_id)
        if stored is None:
            raise APIError(404, f"Response with id '{response_id}' not found.",
                           param="response_id")  # fmt: skip
        return stored

    @router.get("/responses/{response_id}")
    async def retrieve(response_id: str, stream: bool = False) -> dict:
        if stream:
            raise APIError(400, "streaming a stored response again is not supported",
                           param="stream")  # fmt: skip
        return stored_or_404(response_id).builder.snapshot()

    @router.delete("/responses/{response_id}")
    async def delete(response_id: str) -> dict:
        stored = stored_or_404(response_id)
        if stored.task is not None:
            stored.task.cancel()
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @router.post("/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> dict:
        stored = stored_or_404(response_id)
        if not stored.builder.req.background:
            raise APIError(400, "Only background responses can be cancelled.",
                           param="response_id")  # fmt: skip
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
            await asyncio.wait([stored.task])
        return stored.builder.snapshot()
