"""POST /v1/completions: text completion, streamed or not, with echo and legacy logprobs."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from quill.contract.outputs import RequestOutput, TokenLogprobs
from quill.frontend.tokenizer import Tokenizer
from quill.server.context import ServerContext
from quill.server.generation import (
    Generation,
    event_stream,
    json_logprob,
    sse,
    token_text,
    unless_disconnected,
)
from quill.server.kv_transfer import kv_transfer
from quill.server.protocol import CompletionRequest

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create_completion(
    ctx: ServerContext, req: CompletionRequest, raw: Request, arrival_time: float
) -> Response | dict:
    model = ctx.check_model(req.model)
    prompts = req.prompts()
    tok = ctx.tokenizer
    # Before tokenizing: a text too long for the context in any tokenization.
    for p in prompts:
        if isinstance(p, str) and req.truncate_prompt_tokens is None:
            ctx.check_prompt_length(p)
    special = req.add_special_tokens is not False

    def encode() -> list[list[int]]:
        ids = [tok.encode(p, special) if isinstance(p, str) else list(p) for p in prompts]
        return [req.truncate(i, ctx.max_model_len) for i in ids]

    def echo_texts() -> list[str]:  # token ids are known to be in the vocabulary by now
        return [(p if isinstance(p, str) else tok.decode(p)) if req.echo else "" for p in prompts]

    n = req.num_choices
    kv = kv_transfer(ctx, req.kv_transfer_params, len(prompts), n, bool(req.stream), req.echo)
    token_prompts = await asyncio.to_thread(encode)
    params = [req.sampling_params(_DEFAULT_MAX_TOKENS, req.logprobs, j) for j in range(n)]
    scheduling = req.scheduling()
    if kv is not None:
        params = [kv.sampling_params(p) for p in params]
        scheduling |= kv.scheduling()
    gen = Generation(ctx, ctx.request_id(raw.headers, "cmpl"), arrival_time)
    await gen.submit(token_prompts, params, scheduling)
    echoes = await asyncio.to_thread(echo_texts) if req.echo else [""] * len(prompts)
    fmt = _Formatter(gen, model, tok, [echoes[i // n] for i in range(gen.num_choices)])
    if req.stream:
        chunks = fmt.stream(req.include_usage, req.continuous_usage)
        return StreamingResponse(event_stream(gen, chunks), media_type="text/event-stream")
    reply = await unless_disconnected(raw, gen, fmt.collect)
    if kv is not None and isinstance(reply, dict):
        reply["kv_transfer_params"] = kv.reply(gen)
    return reply


class _Formatter:
    """Builds OpenAI `text_completion` objects from engine outputs."""

    def __init__(self, gen: Generation, model: str, tok: Tokenizer, echoes: list[str]) -> None:
        self.gen = gen
        self.tok = tok
        self.echoes = echoes
        self.offsets = [len(e) for e in echoes]  # text_offset of the next token, per choice
        self.head = {
            "id": gen.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _logprobs(self, index: int, token_ids: list[int], entries: list[TokenLogprobs] | None):
        if entries is None:
            return None
        tokens, chosen, top, offsets = [], [], [], []
        for tid, entry in zip(token_ids, entries):
            text = token_text(self.tok, tid)
            tokens.append(text)
            chosen.append(json_logprob(entry.get(tid)))
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])
            top.append({token_text(self.tok, t): json_logprob(lp) for t, lp in ranked})
            offsets.append(self.offsets[index])
            self.offsets[index] += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": chosen,
            "top_logprobs": top,
            "text_offset": offsets,
        }

    async def collect(self) -> dict:
        async for _ in self.gen.outputs():
            pass
        choices = []
        for index in range(self.gen.num_choices):
            c = self.gen.finished[index].outputs[0]
            choices.append(
                {
                    "index": index,
                    "text": self.echoes[index] + c.text,
                    "logprobs": self._logprobs(index, c.token_ids, c.logprobs),
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        return {
            **self.head,
            "choices": choices,
            "usage": self.gen.usage(),
            "metrics": self.gen.timings(),
        }

    async def stream(self, include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        started: set[int] = set()
        async for index, out in self.gen.outputs():
            chunk = self._chunk(index, out, index not in started)
            started.add(index)
            if chunk is None:
                continue
            if continuous_usage:
                chunk["usage"] = self.gen.usage()
            if self.gen.done and not include_usage:
                chunk["metrics"] = self.gen.timings()  # the last chunk of the stream
            yield sse(chunk)
        if include_usage:
            yield sse(
                {
                    **self.head,
                    "choices": [],
                    "usage": self.gen.usage(),
                    "metrics": self.gen.timings(),
                }
            )

    def _chunk(self, index: int, out: RequestOutput, first: bool) -> dict | None:
        c = out.outputs[0]
        text = (self.echoes[index] if first else "") + c.delta_text
        logprobs = self._logprobs(index, c.delta_token_ids, c.delta_logprobs)
        if not text and logprobs is None and not c.finished:
            return None  # text held back (a stop string may be forming): nothing to send yet
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        return {**self.head, "choices": [choice]}
