"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from quill.contract.errors import InvalidRequestError, ModelLoadError
from quill.contract.outputs import RequestOutput, TokenLogprobs
from quill.frontend.tokenizer import Tokenizer
from quill.frontend.tools import ToolChoice
from quill.server.context import ServerContext
from quill.server.generation import (
    Generation,
    json_logprob,
    sse,
    token_text,
    unless_disconnected,
)
from quill.server.kv_transfer import kv_transfer
from quill.server.logprobs import vllm_prompt_logprobs
from quill.server.protocol import ChatCompletionRequest
from quill.server.tools import ToolCalls


def encode_chat(tok: Tokenizer, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    """The conversation's prompt ids; a template that refuses the conversation is a 400."""
    try:
        return tok.encode_chat(messages, add_generation_prompt=add_generation_prompt)
    except ModelLoadError as e:
        raise InvalidRequestError(str(e), param="messages") from e
    except Exception as e:  # jinja raises for conversations its template does not allow
        raise InvalidRequestError(f"chat template error: {e}", param="messages") from e


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, raw: Request, arrival_time: float
) -> Response | dict:
    model = ctx.check_model(req.model)
    tok = ctx.tokenizer
    messages = req.template_messages()
    add_gen = req.add_generation_prompt is not False

    if req.truncate_prompt_tokens is None:
        ctx.check_prompt_length("".join(m["content"] for m in messages), "messages")

    def encode() -> list[int]:
        return req.truncate(encode_chat(tok, messages, add_gen), ctx.max_model_len)

    stream = bool(req.stream)
    kv = kv_transfer(
        ctx, req.kv_transfer_params, 1, req.num_choices, stream, False, req.scores_prompt
    )
    prompt = await asyncio.to_thread(encode)
    # No default cap for chat: the reply may run to the end of the context, as with OpenAI.
    # The prompt is scored once (vLLM's prompt_logprobs: the conversation's, one for all).
    params = [
        req.sampling_params(None, req.num_logprobs, j, req.prompt_logprobs if j == 0 else None)
        for j in range(req.num_choices)
    ]
    scheduling = req.scheduling()
    if kv is not None:
        params = [kv.sampling_params(p) for p in params]
        scheduling |= kv.scheduling()
    gen = Generation.for_request(ctx, "chatcmpl", arrival_time, req, raw)
    await gen.submit([prompt], params, scheduling)
    fmt = _Formatter(gen, model, tok, req.top_logprobs or 0, req.tool_choice_made)
    fmt.prompt = (prompt, req.prompt_logprobs)
    if req.stream:
        chunks = fmt.stream(req.include_usage, req.continuous_usage)
        return gen.stream(chunks)
    reply = await unless_disconnected(raw, gen, fmt.collect)
    if kv is not None and isinstance(reply, dict):
        reply["kv_transfer_params"] = kv.reply(gen)
    return gen.respond(reply)


class _Formatter:
    """Builds OpenAI `chat.completion` and `chat.completion.chunk` objects."""

    def __init__(
        self, gen: Generation, model: str, tok: Tokenizer, top_n: int, tools: ToolChoice | None
    ) -> None:
        self.gen = gen
        self.tok = tok
        self.top_n = top_n
        # Under a tool choice each choice's text is read as calls (or a text answer).
        self.tools = None if tools is None else [ToolCalls(tools) for _ in range(gen.num_choices)]
        self.head = {"id": gen.request_id, "created": int(time.time()), "model": model}
        self.prompt: tuple[list[int], int | None] = ([], None)  # ids, prompt_logprobs' top n

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprobs] | None):
        if entries is None:
            return None
        content = []
        for tid, entry in zip(token_ids, entries):
            ranked = sorted(entry.items(), key=lambda kv: -kv[1])[: self.top_n]
            content.append(
                {
                    **self._token(tid, entry.get(tid)),
                    "top_logprobs": [self._token(t, lp) for t, lp in ranked],
                }
            )
        return {"content": content, "refusal": None}

    def _token(self, token_id: int, logprob: float | None) -> dict:
        text = token_text(self.tok, token_id)
        return {
            "token": text,
            "logprob": json_logprob(logprob),
            "bytes": list(text.encode("utf-8")),
        }

    async def collect(self) -> dict:
        async for _ in self.gen.outputs():
            pass
        choices = []
        for index in range(self.gen.num_choices):
            c = self.gen.finished[index].outputs[0]
            message = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if self.tools is not None:
                message = self.tools[index].message(c.text)
                finish_reason = self.tools[index].finish_reason(finish_reason)
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": self._logprobs(c.token_ids, c.logprobs),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        reply = {**self.head, "object": "chat.completion", "choices": choices}
        token_ids, top_n = self.prompt
        scored = self.gen.finished[0]
        if top_n is not None and scored.prompt_logprobs is not None:
            reply["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tok, token_ids, scored.prompt_logprobs, scored.prompt_logprob_ranks, top_n
            )
        return {**reply, "usage": self.gen.usage(), "metrics": self.gen.timings()}

    def _chunk(self, choice: dict) -> dict:
        return {**self.head, "object": "chat.completion.chunk", "choices": [choice]}

    async def stream(self, include_usage: bool, continuous_usage: bool) -> AsyncIterator[str]:
        # The role comes first, before any token: clients see the reply begin at once.
        for index in range(self.gen.num_choices):
            delta = {"role": "assistant", "content": ""}
            chunk = self._chunk(_choice(index, delta, None, None))
            if continuous_usage:
                chunk["usage"] = self.gen.usage()
            yield sse(chunk)
        async for index, out in self.gen.outputs():
            chunk = self._delta_chunk(index, out)
            if chunk is None:
                continue
            if continuous_usage:
                chunk["usage"] = self.gen.usage()
            if self.gen.done and not include_usage:
                chunk["metrics"] = self.gen.timings()  # the last chunk of the stream
            yield sse(chunk)
        if include_usage:
            last = {**self._chunk({}), "choices": [], "usage": self.gen.usage()}
            yield sse({**last, "metrics": self.gen.timings()})

    def _delta_chunk(self, index: int, out: RequestOutput) -> dict | None:
        c = out.outputs[0]
        logprobs = self._logprobs(c.delta_token_ids, c.delta_logprobs)
        finish_reason = c.finish_reason
        if self.tools is not None:
            delta = self.tools[index].delta(c.delta_text, c.finished)
            finish_reason = self.tools[index].finish_reason(finish_reason)
        else:
            delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
        if not delta and logprobs is None and not c.finished:
            return None  # text held back (a stop string may be forming; a call not yet named)
        return self._chunk(_choice(index, delta, logprobs, finish_reason))


def _choice(index: int, delta: dict, logprobs, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
