"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from pydantic import ValidationError
from starlette.requests import Request
from starlette.responses import Response

from quill.contract.errors import InvalidRequestError
from quill.contract.outputs import RequestOutput, TokenLogprobs
from quill.frontend.chat import ChatTurn, prepare_chat
from quill.frontend.tokenizer import Tokenizer
from quill.server.context import ServerContext
from quill.server.errors import from_validation_error, renamed
from quill.server.generation import Generation, sse, unless_disconnected
from quill.server.kv_transfer import KVTransfer, kv_transfer
from quill.server.logprobs import token_logprobs, vllm_prompt_logprobs
from quill.server.protocol import ChatCompletionRequest
from quill.server.tools import ReplyReader


def translated(ctx: ServerContext, body: dict, names: dict[str, str]) -> ChatCompletionRequest:
    """The chat request another API's request translates into (`body`), validated as chat
    completions are; its errors name the fields as that API does (`names`: ours -> theirs)."""
    try:
        return ChatCompletionRequest.model_validate(body, context={"limits": ctx.json_limits})
    except ValidationError as e:
        raise renamed(from_validation_error(e), names) from None
    except InvalidRequestError as e:
        raise renamed(e, names) from None


def prepare(ctx: ServerContext, req: ChatCompletionRequest) -> ChatTurn:
    """The request's conversation in the served model's chat format (a 400 naming the field
    for what the template or the tools refuse)."""
    return prepare_chat(
        ctx.tokenizer,
        ctx.chat_format,
        req.template_messages(),
        req.functions,
        req.tool_choice_made,
        req.constraint,
        req.constraint_field,
        req.template_kwargs(),
        req.add_generation_prompt is not False,
        req.limits,
    )


@dataclass
class ChatRun:
    """A chat turn handed to the engine: its generation, the prompt as the engine got it, and
    a reader a choice for the reply's parts (thinking, text, calls)."""

    gen: Generation
    turn: ChatTurn
    prompt: list[int]
    readers: list[ReplyReader]


async def start_chat(
    ctx: ServerContext,
    req: ChatCompletionRequest,
    raw: Request,
    arrival_time: float,
    prefix: str = "chatcmpl",
    kv: KVTransfer | None = None,
) -> ChatRun:
    """The one way a conversation reaches the engine, whichever API it came through (chat
    completions, responses, messages): the model's chat format, the limits, admission."""
    messages = req.template_messages()
    if req.truncate_prompt_tokens is None:
        ctx.check_prompt_length("".join(m["content"] for m in messages), "messages")
    turn = await asyncio.to_thread(prepare, ctx, req)
    prompt = req.truncate(turn.prompt_ids, ctx.max_model_len)
    # No default cap for chat: the reply may run to the end of the context, as with OpenAI.
    # The prompt is scored once (vLLM's prompt_logprobs: the conversation's, one for all).
    params = [
        turn.sampling_params(
            req.sampling_params(None, req.num_logprobs, j, req.prompt_logprobs if j == 0 else None),
            req.thinking_budget,
        )
        for j in range(req.num_choices)
    ]
    scheduling = req.scheduling()
    if kv is not None:
        params = [kv.sampling_params(p) for p in params]
        scheduling |= kv.scheduling()
    gen = Generation.for_request(ctx, prefix, arrival_time, req, raw)
    gen.constraint_field = turn.constraint_field
    await gen.submit([prompt], params, scheduling)
    include_reasoning = req.include_reasoning is not False
    readers = [
        ReplyReader(turn.choice, turn.tools, turn.reasoning, turn.opened, include_reasoning)
        for _ in range(gen.num_choices)
    ]
    return ChatRun(gen, turn, prompt, readers)


async def create_chat_completion(
    ctx: ServerContext, req: ChatCompletionRequest, raw: Request, arrival_time: float
) -> Response | dict:
    model = ctx.check_model(req.model)
    stream = bool(req.stream)
    kv = kv_transfer(
        ctx, req.kv_transfer_params, 1, req.num_choices, stream, False, req.scores_prompt
    )
    run = await start_chat(ctx, req, raw, arrival_time, kv=kv)
    gen, turn = run.gen, run.turn
    # Plain text needs no reading: its deltas go out as they come.
    readers = run.readers if turn.choice is not None or turn.reasoning is not None else None
    fmt = _Formatter(gen, model, ctx.tokenizer, req.top_logprobs or 0, readers)
    fmt.prompt = (run.prompt, req.prompt_logprobs)
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
        self,
        gen: Generation,
        model: str,
        tok: Tokenizer,
        top_n: int,
        readers: list[ReplyReader] | None,
    ) -> None:
        self.gen = gen
        self.tok = tok
        self.top_n = top_n
        # Under tools or a reasoning format each choice's text is read into its parts.
        self.readers = readers
        self.head = {"id": gen.request_id, "created": int(time.time()), "model": model}
        self.prompt: tuple[list[int], int | None] = ([], None)  # ids, prompt_logprobs' top n

    def _logprobs(self, token_ids: list[int], entries: list[TokenLogprobs] | None):
        if entries is None:
            return None
        content = token_logprobs(self.tok, token_ids, entries, self.top_n)
        return {"content": content, "refusal": None}

    async def collect(self) -> dict:
        async for _ in self.gen.outputs():
            pass
        choices = []
        for index in range(self.gen.num_choices):
            c = self.gen.finished[index].outputs[0]
            message = {"role": "assistant", "content": c.text}
            finish_reason = c.finish_reason
            if self.readers is not None:
                message = self.readers[index].message(c.text)
                finish_reason = self.readers[index].finish_reason(finish_reason)
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
        if self.readers is not None:
            delta = self.readers[index].delta(c.delta_text, c.finished)
            finish_reason = self.readers[index].finish_reason(finish_reason)
        else:
            delta = {"content": c.delta_text} if c.delta_text or not c.finished else {}
        if not delta and logprobs is None and not c.finished:
            return None  # text held back (a stop string may be forming; a call not yet named)
        return self._chunk(_choice(index, delta, logprobs, finish_reason))


def _choice(index: int, delta: dict, logprobs, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
