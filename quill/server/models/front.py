"""The front of a multi-model server: one address for all its models.

Each loaded model is served by its own app (quill/server/app.py: every API, its metrics, its
console), over its own engine process (quill/server/models/pool.py). The front reads each
request's `model` (the JSON body's; a GET's `?model=`; else the default, the first model),
loads the model if it must, and hands the request to that app, with the seconds it waited for
the load in a header (Ollama's `load_duration`). The front answers itself what concerns all
models: `/v1/models` (each with whether it is loaded), Ollama's `/api/tags`, `/api/ps`,
`/api/version`, `/api/show` (from the files, without loading), `/health`, `/metrics` (every
loaded model's, merged, and the pool's own), and Ollama's load / unload requests (an empty
chat or generate; `keep_alive` 0 unloads). A model's console is at `/?model=NAME` (the page's
own requests carry it as their Referer); a GET that names no model goes to the most recently
used loaded one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError

import quill
from quill.contract.errors import InvalidRequestError
from quill.server.errors import (
    APIError,
    from_invalid,
    from_validation_error,
    install_error_handlers,
)
from quill.server.guard import RequestGuard
from quill.server.models.pool import ModelPool, Slot
from quill.server.ollama.protocol import OllamaShowRequest, keep_alive_seconds
from quill.server.ollama.routes import (
    LOAD_HEADER,
    install_ollama_models,
    now,
    running,
    show,
)

log = logging.getLogger(__name__)

_OLLAMA_LOAD_PATHS = ("/api/chat", "/api/generate")
_FRONT = {("GET", "/v1/models"), ("GET", "/api/tags"), ("GET", "/api/ps"),
          ("GET", "/api/version"), ("GET", "/version"), ("GET", "/health"),
          ("GET", "/metrics"), ("POST", "/api/show")}  # fmt: skip


class _PoolMetrics:
    """The pool's own figures, read at each scrape, and every loaded model's registry merged
    into one exposition (each model's samples carry its model_name)."""

    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self):
        loaded = GaugeMetricFamily("quill:models_loaded", "Models loaded now.")
        loaded.add_metric([], len(self.pool.loaded()))
        yield loaded
        resident = GaugeMetricFamily("quill:model_resident_bytes",
                                     "Memory each loaded model's engine holds.",
                                     labels=["model_name"])  # fmt: skip
        loads = CounterMetricFamily("quill:model_loads", "Times each model was loaded.",
                                    labels=["model_name"])  # fmt: skip
        seconds = GaugeMetricFamily("quill:model_load_seconds",
                                    "How long each model's last load took.",
                                    labels=["model_name"])  # fmt: skip
        for slot in self.pool.slots.values():
            if slot.state == "loaded":
                resident.add_metric([slot.entry.name], slot.rss)
            loads.add_metric([slot.entry.name], slot.loads)
            if slot.loads:
                seconds.add_metric([slot.entry.name], slot.load_seconds)
        yield resident
        yield loads
        yield seconds
        families: dict = {}
        for slot in self.pool.loaded():
            for family in slot.ctx.metrics.registry.collect():
                if family.name in families:
                    families[family.name].samples += family.samples
                else:
                    families[family.name] = family
        yield from families.values()


def build_front(pool: ModelPool, api_key, max_request_bytes, body_timeout,
                metrics_require_key: bool) -> FastAPI:  # fmt: skip
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        clock = asyncio.ensure_future(pool.run_idle_clock())
        try:
            yield
        finally:
            clock.cancel()
            await pool.close()

    app = FastAPI(title="quill", version=quill.__version__, lifespan=lifespan, docs_url=None,
                  redoc_url=None, openapi_url=None)  # fmt: skip
    install_error_handlers(app)
    app.add_middleware(_Dispatch, pool=pool)
    app.add_middleware(
        RequestGuard,
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        body_timeout=body_timeout,
        metrics_require_key=metrics_require_key,
    )
    registry = CollectorRegistry()
    registry.register(_PoolMetrics(pool))

    def card(slot: Slot) -> dict:
        ctx = slot.ctx
        return {"id": slot.entry.name, "object": "model", "created": created,
                "owned_by": "quill", "root": str(slot.entry.path), "parent": None,
                "max_model_len": ctx.max_model_len if ctx else slot.config.max_model_len,
                "loaded": slot.state == "loaded",
                "status": {"value": slot.state}}  # fmt: skip

    @app.get("/v1/models")
    async def list_models() -> dict:
        return {"object": "list", "data": [card(s) for s in pool.slots.values()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> dict:
        return card(pool.slot(model_id))

    def processes() -> list[dict]:
        return [running(s.entry, s.rss, pool.expires_at(s), s.ctx) for s in pool.loaded()]

    install_ollama_models(app, lambda: [s.entry for s in pool.slots.values()], processes)

    @app.post("/api/show")
    async def api_show(request: Request) -> dict:
        try:
            req = OllamaShowRequest.model_validate_json(await request.body())
        except ValidationError as e:
            raise from_validation_error(e) from None
        slot = pool.slot(req.model or req.name)
        return show(slot.entry, slot.ctx)

    @app.get("/health")
    async def health() -> Response:
        dead = [s.entry.name for s in pool.loaded() if not s.ctx.engine.is_alive]
        if dead:
            raise APIError(503, f"the engine of {', '.join(dead)} is not running", "server_error")
        return JSONResponse({"status": "ok", "loaded": [s.entry.name for s in pool.loaded()]})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict:
        return {"version": quill.__version__}

    return app


class _Dispatch:
    """ASGI middleware (inside the guard): a request for a model goes to its app."""

    def __init__(self, app, pool: ModelPool) -> None:
        self.app = app
        self.pool = pool

    async def __call__(self, scope, receive, send) -> None:
        path, method = scope.get("path", ""), scope.get("method", "")
        if scope["type"] != "http" or (method, path) in _FRONT or path.startswith("/v1/models/"):
            await self.app(scope, receive, send)
            return
        body, data = b"", {}
        if method == "POST":
            body = await _read_body(receive)
            try:
                data = json.loads(body)
            except ValueError:
                data = {}
            data = data if isinstance(data, dict) else {}
        name = data.get("model") if isinstance(data.get("model"), str) else None
        if name is None and method != "POST":
            name = _query_model(scope) or _recent(self.pool)
        try:
            slot = self.pool.slot(name)
            keep = keep_alive_seconds(data.get("keep_alive")) if path.startswith("/api/") else None
        except InvalidRequestError as e:
            await from_invalid(e)(scope, receive, send)
            return
        except APIError as e:
            await e(scope, receive, send)
            return
        empty = path in _OLLAMA_LOAD_PATHS and not data.get("messages") and not data.get(
            "prompt") and data.get("suffix") is None  # fmt: skip
        if empty and keep == 0:  # Ollama's unload request: nothing to load first
            self.pool.used_by(slot, 0)  # busy: the idle clock unloads it once it is not
            if not slot.busy:
                await self.pool.unload(slot, "keep_alive 0")
            reply = {"model": slot.entry.name, "created_at": now(), "done": True,
                     "done_reason": "unload"}  # fmt: skip
            if path == "/api/chat":
                reply["message"] = {"role": "assistant", "content": ""}
            else:
                reply["response"] = ""
            await JSONResponse(reply)(scope, receive, send)
            return
        slot.active += 1  # before the load: a model being asked for is not idle
        try:
            try:
                waited = await self.pool.ready(slot)
            except APIError as e:
                await e(scope, receive, send)
                return
            self.pool.used_by(slot, keep)
            headers = [(k, v) for k, v in scope["headers"] if k != LOAD_HEADER.encode()]
            headers.append((LOAD_HEADER.encode(), f"{waited:.6f}".encode()))
            await slot.app({**scope, "headers": headers}, _replay(body, receive), send)
        finally:
            slot.active -= 1
            self.pool.touch(slot)
        if keep == 0 and not slot.busy:
            await self.pool.unload(slot, "keep_alive 0")


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def _replay(body: bytes, receive):
    """`receive` for the model's app: the body read already, then the client's messages
    (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _query_model(scope) -> str | None:
    """A GET's `?model=`, or the one of the page that made it (a console opened at
    `/?model=NAME` fetches its state with that page as its Referer)."""
    from urllib.parse import parse_qs, urlsplit

    values = parse_qs(scope.get("query_string", b"").decode()).get("model")
    if values:
        return values[0]
    referer = dict(scope.get("headers", [])).get(b"referer", b"").decode("latin-1")
    values = parse_qs(urlsplit(referer).query).get("model")
    return values[0] if values else None


def _recent(pool: ModelPool) -> str | None:
    """The most recently used loaded model (a GET names none: the console, a stored response)."""
    loaded = sorted(pool.loaded(), key=lambda s: s.last_used)
    return loaded[-1].entry.name if loaded else None
