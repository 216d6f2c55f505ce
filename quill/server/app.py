"""The FastAPI application: routes, API-key check, and the engine's start and stop."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import quill
from quill.server.chat import create_chat_completion, render_chat
from quill.server.completions import create_completion
from quill.server.context import ServerContext
from quill.server.errors import APIError, bad_request, from_validation_error, install_error_handlers
from quill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

_ARRIVAL = "quill.arrival_time"


class _StampArrival:
    """Outermost ASGI layer: notes when a request arrived, before any parsing or routing."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            scope[_ARRIVAL] = time.monotonic()
        await self.app(scope, receive, send)


def _digest(text: str) -> bytes:
    return hashlib.sha256(text.encode()).digest()


async def _parse(request: Request, schema: type[BaseModel]):
    body = await request.body()
    try:
        return schema.model_validate_json(body)
    except ValidationError as e:
        raise from_validation_error(e) from None


def _respond(result) -> Response:
    return result if isinstance(result, Response) else JSONResponse(result)


def build_app(ctx: ServerContext) -> FastAPI:
    """The app for one engine; the engine thread starts and stops with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.stop()

    app = FastAPI(title="quill", version=quill.__version__, lifespan=lifespan)
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(_StampArrival)
    expected_key = _digest(f"Bearer {ctx.api_key}") if ctx.api_key else None

    async def check_api_key(request: Request) -> None:
        if expected_key is None:
            return
        # Digests compare in constant time and do not leak the key's length either.
        given = _digest(request.headers.get("authorization", ""))
        if not hmac.compare_digest(given, expected_key):
            raise APIError(
                401,
                "Incorrect or missing API key. Send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])

    def arrival(request: Request) -> float:
        return request.scope.get(_ARRIVAL) or time.monotonic()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        t = arrival(request)
        req = await _parse(request, CompletionRequest)
        return _respond(await create_completion(ctx, req, request, t))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t = arrival(request)
        req = await _parse(request, ChatCompletionRequest)
        return _respond(await create_chat_completion(ctx, req, request, t))

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "quill",
            "root": str(ctx.engine.engine.model_path),
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in ctx.served_model_names]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        return model_card(ctx.check_model(model_id))

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_alive:
            raise APIError(503, "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": quill.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await _parse(request, TokenizeRequest)
        ctx.check_model(req.model)
        tok = ctx.tokenizer

        def work() -> dict:
            if req.messages is not None:
                messages = [m.as_template_dict() for m in req.messages]
                ids = tok.encode(render_chat(tok, messages, req.add_generation_prompt is not False))
            else:
                ids = tok.encode(req.prompt or "", req.add_special_tokens is not False)
            out = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
            if req.return_token_strs:
                out["token_strs"] = [tok.id_to_token(t) for t in ids]
            return out

        return await asyncio.to_thread(work)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await _parse(request, DetokenizeRequest)
        ctx.check_model(req.model)
        tok = ctx.tokenizer
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})", "tokens"
            )
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}

    return app
