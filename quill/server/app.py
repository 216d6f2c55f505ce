"""The FastAPI application: routes, the door every request passes (guard), and the engine's
start and stop."""

from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError

import quill
from quill.frontend.chat import prepare_chat
from quill.server.chat import create_chat_completion
from quill.server.completions import create_completion
from quill.server.console.routes import install_console, login_page
from quill.server.constraints import CONSTRAINT_FIELDS
from quill.server.context import ServerContext
from quill.server.embeddings import EmbeddingRequest, create_embedding
from quill.server.errors import APIError, bad_request, from_validation_error, install_error_handlers
from quill.server.fields import ignored_fields
from quill.server.guard import ARRIVAL, RequestGuard
from quill.server.infill import InfillRequest, create_infill
from quill.server.messages.protocol import CountTokensRequest, MessagesRequest
from quill.server.messages.routes import install_messages
from quill.server.models.catalog import ModelEntry
from quill.server.models.memory import process_tree_rss
from quill.server.ollama.protocol import (
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
)
from quill.server.ollama.routes import install_ollama, install_ollama_models, running
from quill.server.openapi import install_openapi
from quill.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from quill.server.responses.protocol import ResponsesRequest
from quill.server.responses.routes import install_responses
from quill.server.responses.store import ResponseStore
from quill.server.scoring import RerankRequest, ScoreRequest, create_rerank, create_score

log = logging.getLogger(__name__)


class _IgnoredFieldLog:
    """Warns once per field name that requests carry and quill ignores; later ones at debug."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, path: str, names: list[str]) -> None:
        new = [n for n in names if n not in self.seen]
        self.seen.update(new)
        level = logging.WARNING if new else logging.DEBUG
        log.log(level, "%s: ignored request fields quill does not know: %s", path, ", ".join(names))


def _respond(result) -> Response:
    return result if isinstance(result, Response) else JSONResponse(result)


def build_app(
    ctx: ServerContext, manage_engine: bool = True, store: ResponseStore | None = None
) -> FastAPI:
    """The app for one engine; the engine starts and stops with the app's lifespan (unless
    `manage_engine` is false: a multi-model server's pool starts and stops it). `store`: the
    Responses API's store, when several apps share one."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if not manage_engine:
            yield
            return
        await ctx.engine.start()
        try:
            yield
        finally:
            await ctx.engine.stop()

    docs = ctx.enable_api_docs
    app = FastAPI(
        title="quill",
        version=quill.__version__,
        lifespan=lifespan,
        docs_url="/docs" if docs else None,
        redoc_url=None,
        openapi_url="/openapi.json" if docs else None,
    )
    app.state.ctx = ctx
    install_error_handlers(app)
    app.add_middleware(
        RequestGuard,
        api_key=ctx.api_key,
        max_request_bytes=ctx.max_request_bytes,
        body_timeout=ctx.request_body_timeout,
        metrics_require_key=ctx.metrics_require_key,
        pages=login_page if ctx.console else None,
    )
    if ctx.console:
        install_console(app, ctx)
    note_ignored = _IgnoredFieldLog()
    validation = {"limits": ctx.json_limits}

    async def parse(request: Request, schema: type[BaseModel]):
        try:
            req = schema.model_validate_json(await request.body(), context=validation)
        except ValidationError as e:
            error = from_validation_error(e)
            if error.param in CONSTRAINT_FIELDS:
                ctx.metrics.structured_refused.inc()
            raise error from None
        names = ignored_fields(req)
        if names:
            note_ignored(request.url.path, names)
        return req

    v1 = APIRouter(prefix="/v1")

    def arrival(request: Request) -> float:
        return request.scope.get(ARRIVAL) or time.monotonic()

    @v1.post("/completions")
    async def completions(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, CompletionRequest)
        return _respond(await create_completion(ctx, req, request, t))

    @v1.post("/chat/completions")
    async def chat_completions(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, ChatCompletionRequest)
        return _respond(await create_chat_completion(ctx, req, request, t))

    @v1.post("/embeddings")
    async def embeddings(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, EmbeddingRequest)
        return _respond(await create_embedding(ctx, req, request, t))

    async def rerank(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, RerankRequest)
        return _respond(await create_rerank(ctx, req, request, t))

    async def score(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, ScoreRequest)
        return _respond(await create_score(ctx, req, request, t))

    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):  # Jina's, Cohere's and bare
        app.add_api_route(path, rerank, methods=["POST"])
    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"])

    @app.post("/infill")
    async def infill(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, InfillRequest)
        return _respond(await create_infill(ctx, req, request, t))

    def model_card(name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "quill",
            "root": ctx.engine.info.model_path,
            "parent": None,
            "max_model_len": ctx.max_model_len,
        }

    @v1.get("/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [model_card(n) for n in ctx.served_model_names]}

    @v1.get("/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        return model_card(ctx.check_model(model_id))

    store = store or ResponseStore(ctx.responses_store_bytes, ctx.responses_store_ttl)
    install_responses(v1, ctx, parse, arrival, store)
    install_messages(v1, ctx, parse, arrival)
    entry = ModelEntry(ctx.model_name, Path(ctx.engine.info.model_path))
    install_ollama(app, ctx, parse, arrival, entry)
    install_ollama_models(
        app, lambda: [entry], lambda: [running(entry, process_tree_rss(ctx.engine.pid), None, ctx)]
    )
    app.state.responses = store
    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_alive:
            raise APIError(503, "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/v1/loads")
    async def loads() -> dict:
        return load_report(ctx)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": quill.__version__}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        req = await parse(request, TokenizeRequest)
        ctx.check_model(req.model)
        tok = ctx.tokenizer
        if req.prompt is not None:
            ctx.check_prompt_length(req.prompt)

        def work() -> dict:
            if req.messages is not None:
                add_gen = req.add_generation_prompt is not False
                turn = prepare_chat(tok, ctx.chat_format, req.template_messages(),
                                    add_generation_prompt=add_gen, limits=req.limits)  # fmt: skip
                ids = turn.prompt_ids
            else:
                ids = tok.encode(req.prompt or "", req.add_special_tokens is not False)
            out = {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}
            if req.return_token_strs:
                out["token_strs"] = [tok.id_to_token(t) for t in ids]
            return out

        return await asyncio.to_thread(work)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        req = await parse(request, DetokenizeRequest)
        ctx.check_model(req.model)
        tok = ctx.tokenizer
        bad = [t for t in req.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise bad_request(
                f"token id {bad[0]} is outside the vocabulary [0, {tok.vocab_size})", "tokens"
            )
        return {"prompt": await asyncio.to_thread(tok.decode, req.tokens)}

    install_openapi(
        app,
        {
            "/v1/completions": CompletionRequest,
            "/v1/chat/completions": ChatCompletionRequest,
            "/v1/responses": ResponsesRequest,
            "/v1/embeddings": EmbeddingRequest,
            "/v1/rerank": RerankRequest,
            "/v1/score": ScoreRequest,
            "/v1/messages": MessagesRequest,
            "/v1/messages/count_tokens": CountTokensRequest,
            "/tokenize": TokenizeRequest,
            "/detokenize": DetokenizeRequest,
            "/api/chat": OllamaChatRequest,
            "/api/generate": OllamaGenerateRequest,
            "/api/embed": OllamaEmbedRequest,
        },
    )
    return app


def load_report(ctx: ServerContext) -> dict:
    """What a router weighs this replica by (GET /v1/loads): the engine's queues at its last
    step, the requests this server has sent it and not seen finish (fresher: a request is
    counted here before the engine's next step), the KV blocks in use, and where the KV-cache
    events are published (quill/engine/kv_events.py), if they are."""
    stats = ctx.metrics.last_stats
    config = ctx.engine.config
    events = config.kv_events
    return {
        "object": "loads",
        "model": ctx.model_name,
        "running": stats.num_running if stats else 0,
        "waiting": stats.num_waiting if stats else 0,
        "requests_in_flight": ctx.engine.num_in_flight,
        "kv_blocks_used": stats.kv_blocks_used if stats else 0,
        "kv_blocks_total": ctx.engine.info.num_kv_tokens // config.block_size,
        "kv_cache_usage": stats.kv_cache_usage if stats else 0.0,
        "num_tokens_in_flight": stats.num_tokens_in_flight if stats else 0,
        "block_size": config.block_size,
        "data_parallel_rank": config.data_parallel_rank,
        "kv_events": None
        if events is None
        else {
            "endpoint": events.endpoint,
            "replay_endpoint": events.replay_endpoint,
            "topic": events.topic,
        },
    }
