"""Ollama's API beside OpenAI's, for the desktop tools that speak it: `/api/chat`,
`/api/generate` (streamed as NDJSON by default, whole with `stream: false`), `/api/embed`,
`/api/embeddings`, `/api/show`, `/api/tags`, `/api/ps`, `/api/version`.

A chat (and a templated generate) becomes a chat completions request and runs as one
(`start_chat`: the chat format, tools, thinking, limits, admission, metrics); a raw or infill
generate runs as a completion (`start_completion`); embeddings as OpenAI's (`embed`). The reply
is read into its parts (quill/server/reply_parts.py): thinking goes to `thinking`, text to
`content` / `response`, a tool call whole into `tool_calls` once its arguments are complete.
Timings come in Ollama's fields, in nanoseconds. Errors are `{"error": "..."}` with the status
(quill/server/errors.py); a stream that fails ends with an error line.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

import quill
from quill.contract.errors import InvalidRequestError
from quill.server.chat import start_chat, translated
from quill.server.completions import start_completion
from quill.server.context import ServerContext
from quill.server.embeddings import embed
from quill.server.engine_client import EngineFailure
from quill.server.errors import APIError, from_validation_error, renamed
from quill.server.generation import Generation, RequestFailed, unless_disconnected
from quill.server.models.catalog import ModelEntry
from quill.server.ollama.protocol import (
    CHAT_PARAMS,
    OllamaChatRequest,
    OllamaEmbedRequest,
    OllamaGenerateRequest,
    OllamaLegacyEmbeddingsRequest,
    OllamaShowRequest,
)
from quill.server.protocol import CompletionRequest
from quill.server.reply_parts import CALL, REASONING, TEXT, PartStream

log = logging.getLogger(__name__)

# The header the multi-model front sets on a request that waited for its model to load (s).
LOAD_HEADER = "x-quill-load-duration"


def now() -> str:
    """Ollama's created_at: RFC 3339, UTC."""
    return datetime.now(UTC).isoformat().replace("+00:00", "Z")


def ns(seconds: float | None) -> int:
    return int((seconds or 0.0) * 1e9)


def timings(gen: Generation, raw: Request) -> dict:
    """Ollama's counts and durations (ns) for a finished generation."""
    t = gen.timings()
    load = float(raw.headers.get(LOAD_HEADER, 0) or 0)
    return {
        "total_duration": ns((t["e2e_latency"] or 0) + load),
        "load_duration": ns(load),
        "prompt_eval_count": t["num_prompt_tokens"],
        "prompt_eval_duration": ns(t["prefill_time"]),
        "eval_count": t["num_generation_tokens"],
        "eval_duration": ns(t["decode_time"]),
    }


def capabilities(entry: ModelEntry, ctx: ServerContext | None) -> list[str]:
    """What the model does, as Ollama lists it: a loaded model's by its served formats, else
    read from its chat template."""
    if ctx is not None and ctx.engine.info is not None and ctx.engine.info.task != "generate":
        return ["embedding"]
    if ctx is not None:
        fmt = ctx.chat_format
        caps = ["completion", "tools"]
        return caps + (["thinking"] if fmt.reasoning is not None else [])
    template = entry.template or ""
    caps = ["completion"] + (["tools"] if "tools" in template else [])
    return caps + (["thinking"] if "think" in template else [])


def show(entry: ModelEntry, ctx: ServerContext | None) -> dict:
    return {
        "modelfile": f"FROM {entry.path}\n",
        "parameters": "",
        "template": entry.template or "",
        "details": entry.details(),
        "model_info": entry.model_info(),
        "capabilities": capabilities(entry, ctx),
        "modified_at": entry.modified_at,
    }


def tag(entry: ModelEntry) -> dict:
    return {"name": entry.name, "model": entry.name, "modified_at": entry.modified_at,
            "size": entry.size, "digest": entry.digest, "details": entry.details()}  # fmt: skip


def running(entry: ModelEntry, size: int, expires_at: float | None, ctx: ServerContext) -> dict:
    """One `/api/ps` entry (`expires_at`: wall time it unloads; None: never)."""
    until = datetime.fromtimestamp(expires_at, UTC) if expires_at else datetime(2318, 1, 1)
    return {**tag(entry), "size": size, "size_vram": 0,
            "expires_at": until.isoformat().replace("+00:00", "Z"),
            "context_length": ctx.max_model_len}  # fmt: skip


def version() -> dict:
    return {"version": quill.__version__}


def install_ollama_models(
    router: APIRouter, entries: Callable[[], list[ModelEntry]], processes: Callable[[], list]
) -> None:
    """/api/tags, /api/ps, /api/version (`processes`: the loaded models' /api/ps entries)."""

    @router.get("/api/tags")
    async def tags() -> dict:
        return {"models": [tag(e) for e in entries()]}

    @router.get("/api/ps")
    async def ps() -> dict:
        return {"models": processes()}

    @router.get("/api/version")
    async def get_version() -> dict:
        return version()


def install_ollama(
    router: APIRouter, ctx: ServerContext, parse, arrival, entry: ModelEntry
) -> None:
    """The routes that run the model (chat, generate, embed, show) on `router` (the app's
    root), for the model `entry` served by `ctx`."""

    def check(name: str | None) -> None:
        if name is not None and name not in ctx.served_model_names:
            raise APIError(404, f"model '{name}' not found", param="model")

    @router.post("/api/show")
    async def api_show(request: Request) -> dict:
        req = await parse(request, OllamaShowRequest)
        check(req.model or req.name)
        return show(entry, ctx)

    @router.post("/api/chat")
    async def api_chat(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, OllamaChatRequest)
        check(req.model)
        if not req.messages:  # Ollama's way to load (or, keep_alive 0, unload) a model
            done = "unload" if req.keep_alive_s == 0 else "load"
            return JSONResponse({"model": req.model, "created_at": now(), "done": True,
                                 "done_reason": done,
                                 "message": {"role": "assistant", "content": ""}})  # fmt: skip
        chat = translated(ctx, req.chat_request(), CHAT_PARAMS)
        try:
            run = await start_chat(ctx, chat, request, t, prefix="chat")
        except InvalidRequestError as e:
            raise renamed(e, CHAT_PARAMS) from None
        reply = _Reply(req.model, run.gen, request, PartStream(run.readers[0]), chat=True)
        return await reply.respond(req.stream is not False)

    @router.post("/api/generate")
    async def api_generate(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, OllamaGenerateRequest)
        check(req.model)
        if not req.prompt and req.suffix is None:
            done = "unload" if req.keep_alive_s == 0 else "load"
            return JSONResponse({"model": req.model, "created_at": now(), "response": "",
                                 "done": True, "done_reason": done})  # fmt: skip
        try:
            if req.as_text:
                body = {**req.completion_request(), "stream": False}
                try:
                    completion = CompletionRequest.model_validate(
                        body, context={"limits": ctx.json_limits}
                    )
                except ValidationError as e:  # named as Ollama names the fields
                    raise renamed(from_validation_error(e), CHAT_PARAMS) from None
                gen, prompts = await start_completion(ctx, completion, request, t, None,
                                                      "gen", None)  # fmt: skip
                parts, prompt = None, prompts[0]
            else:
                chat = translated(ctx, req.chat_request(), CHAT_PARAMS)
                run = await start_chat(ctx, chat, request, t, prefix="gen")
                gen, parts, prompt = run.gen, PartStream(run.readers[0]), run.prompt
        except InvalidRequestError as e:
            raise renamed(e, CHAT_PARAMS) from None
        reply = _Reply(req.model, gen, request, parts, chat=False, prompt=prompt)
        return await reply.respond(req.stream is not False)

    @router.post("/api/embed")
    async def api_embed(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, OllamaEmbedRequest)
        check(req.model)
        pooling = ctx.pooling.params(req.dimensions, None)
        k = ctx.max_model_len
        cut = (lambda ids: ids[:k]) if req.truncate is not False else None  # Ollama keeps the start
        result = await embed(ctx, req.inputs(), pooling, request, t, cut)
        if isinstance(result, Response):
            return result
        vectors, tokens = result
        load = float(request.headers.get(LOAD_HEADER, 0) or 0)
        return JSONResponse({"model": req.model, "embeddings": vectors,
                             "total_duration": ns(time.monotonic() - t + load),
                             "load_duration": ns(load), "prompt_eval_count": tokens})  # fmt: skip

    @router.post("/api/embeddings")
    async def api_embeddings(request: Request) -> Response:
        t = arrival(request)
        req = await parse(request, OllamaLegacyEmbeddingsRequest)
        check(req.model)
        if not req.prompt:  # the old endpoint answers an empty prompt with an empty vector
            return JSONResponse({"embedding": []})
        result = await embed(ctx, [req.prompt], ctx.pooling.params(None, None), request, t)
        if isinstance(result, Response):
            return result
        return JSONResponse({"embedding": result[0][0]})


class _Reply:
    """A generation's reply in Ollama's shape: NDJSON chunks, or one object."""

    def __init__(
        self,
        model: str,
        gen: Generation,
        raw: Request,
        parts: PartStream | None,
        chat: bool,
        prompt: list[int] | None = None,
    ) -> None:
        self.model, self.gen, self.raw, self.parts, self.chat = model, gen, raw, parts, chat
        self.prompt = prompt
        self.calls: list[dict] = []

    def _chunk(self, text: str = "", thinking: str = "", calls: list | None = None) -> dict:
        if self.chat:
            message: dict = {"role": "assistant", "content": text}
            if thinking:
                message["thinking"] = thinking
            if calls:
                message["tool_calls"] = calls
            return {"model": self.model, "created_at": now(), "message": message, "done": False}
        chunk = {"model": self.model, "created_at": now(), "response": text, "done": False}
        return chunk | ({"thinking": thinking} if thinking else {})

    def _pieces(self, text: str, finished: bool) -> list[dict]:
        """The chunks one piece of the reply makes."""
        if self.parts is None:
            return [self._chunk(text)] if text else []
        out = []
        for event in self.parts.feed(text, finished):
            part = event.part
            if event.kind == "delta" and part.kind == TEXT:
                out.append(self._chunk(text=event.piece))
            elif event.kind == "delta" and part.kind == REASONING:
                out.append(self._chunk(thinking=event.piece))
            elif event.kind == "close" and part.kind == CALL:
                call = {"function": {"name": part.name, "arguments": part.arguments(),
                                     "index": len(self.calls)}, "id": part.call_id}  # fmt: skip
                self.calls.append(call)
                out.append(self._chunk(calls=[call]))
        return out

    def _final(self, finish_reason: str | None, token_ids: list[int]) -> dict:
        done = {**self._chunk(), "done": True,
                "done_reason": "length" if finish_reason == "length" else "stop",
                **timings(self.gen, self.raw)}  # fmt: skip
        if not self.chat and self.prompt is not None:
            done["context"] = self.prompt + token_ids
        return done

    async def _drive(self) -> AsyncIterator[dict]:
        out = None
        async for _, out in self.gen.outputs():
            c = out.outputs[0]
            for chunk in self._pieces(c.delta_text, c.finished):
                yield chunk
        c = out.outputs[0]
        yield self._final(c.finish_reason, c.token_ids)

    async def _lines(self) -> AsyncIterator[str]:
        try:
            try:
                async for chunk in self._drive():
                    yield json.dumps(chunk, ensure_ascii=False) + "\n"
            except (RequestFailed, EngineFailure) as e:
                yield json.dumps({"error": str(getattr(e, "message", e))}) + "\n"
            except Exception:
                log.exception("%s failed", self.gen.name)
                yield json.dumps({"error": "internal server error"}) + "\n"
        finally:
            self.gen.abort()

    async def _whole(self) -> dict:
        text, thinking, final = [], [], {}
        async for chunk in self._drive():
            if chunk["done"]:
                final = chunk
            elif self.chat:
                text.append(chunk["message"]["content"])
                thinking.append(chunk["message"].get("thinking", ""))
            else:
                text.append(chunk["response"])
                thinking.append(chunk.get("thinking", ""))
        if self.chat:
            message = {"role": "assistant", "content": "".join(text)}
            if any(thinking):
                message["thinking"] = "".join(thinking)
            if self.calls:
                message["tool_calls"] = self.calls
            return {**final, "message": message}
        whole = {**final, "response": "".join(text)}
        return whole | ({"thinking": "".join(thinking)} if any(thinking) else {})

    async def respond(self, stream: bool) -> Response:
        if stream:
            return StreamingResponse(self._lines(), media_type="application/x-ndjson")
        reply = await unless_disconnected(self.raw, self.gen, self._whole)
        return reply if isinstance(reply, Response) else JSONResponse(reply)
