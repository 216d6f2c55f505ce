"""POST /v1/completions: text completion, streamed or not, with echo and legacy logprobs.

Echo with logprobs scores the prompt (the engine's prompt logprobs): the choice's `logprobs`
then covers the echoed prompt's tokens, the first with a null logprob, before the generated
ones; with max_tokens 0 nothing is generated and the prompt alone comes back, scored, which is
how evaluation harnesses (lm-evaluation-harness's local-completions) ask for loglikelihoods.
vLLM's `prompt_logprobs` field gives the same numbers in vLLM's shape, per choice.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from quill.contract.outputs import RequestOutput
from quill.frontend.infill import infill_prompt
from quill.frontend.tokenizer import Tokenizer
from quill.server.context import ServerContext
from quill.server.generation import Generation, sse, unless_disconnected
from quill.server.kv_transfer import KVTransfer, kv_transfer
from quill.server.logprobs import TextOffsets, join, legacy_logprobs, vllm_prompt_logprobs
from quill.server.protocol import CompletionRequest

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


async def create_completion(
    ctx: ServerContext, req: CompletionRequest, raw: Request, arrival_time: float
) -> Response | dict:
    model = ctx.check_model(req.model)
    prompts = req.prompts()
    tok, special = ctx.tokenizer, req.add_special_tokens is not False
    n = req.num_choices
    scoring = req.max_tokens_asked == 0 or req.prompt_logprobs is not None
    kv = kv_transfer(
        ctx, req.kv_transfer_params, len(prompts), n, bool(req.stream), req.echo, scoring
    )
    gen, token_prompts = await start_completion(ctx, req, raw, arrival_time, kv)
    echo_scored = bool(req.echo) and req.logprobs is not None
    echoes = [_Echo(tok, p, ids, special, echo_scored) for p, ids in zip(prompts, token_prompts)]
    if req.echo:
        await asyncio.to_thread(lambda: [e.render() for e in echoes])
    fmt = _Formatter(gen, model, tok, req, [echoes[i // n] for i in range(gen.num_choices)])
    if req.stream:
        chunks = fmt.stream(req.include_usage, req.continuous_usage)
        return gen.stream(chunks)
    reply = await unless_disconnected(raw, gen, fmt.collect)
    if kv is not None and isinstance(reply, dict):
        reply["kv_transfer_params"] = kv.reply(gen)
    return gen.respond(reply)


async def start_completion(
    ctx: ServerContext,
    req: CompletionRequest,
    raw: Request,
    arrival_time: float,
    kv: KVTransfer | None = None,
    prefix: str = "cmpl",
    default_max_tokens: int | None = _DEFAULT_MAX_TOKENS,
) -> tuple[Generation, list[list[int]]]:
    """The one way a text prompt reaches the engine, whichever API it came through
    (completions; Ollama's raw generate): tokenized (or its infill prompt), truncated, its
    limits checked, submitted. Returns the generation and the prompts' token ids.
    `default_max_tokens` None: the reply may run to the end of the context."""
    prompts = req.prompts()
    tok = ctx.tokenizer
    # Before tokenizing: a text too long for the context in any tokenization.
    for p in prompts:
        if isinstance(p, str) and req.truncate_prompt_tokens is None:
            ctx.check_prompt_length(p)
    if req.suffix is not None:
        ctx.check_prompt_length(req.suffix, "suffix")
    special = req.add_special_tokens is not False

    def encode() -> list[list[int]]:
        if req.suffix is not None:
            ids = [infill_prompt(tok, p, req.suffix) for p in prompts]
        else:
            ids = [tok.encode(p, special) if isinstance(p, str) else list(p) for p in prompts]
        return [req.truncate(i, ctx.max_model_len) for i in ids]

    token_prompts = await asyncio.to_thread(encode)
    num_scored = req.num_prompt_logprobs
    params = [
        req.sampling_params(default_max_tokens, req.logprobs, j, num_scored)
        for j in range(req.num_choices)
    ]
    scheduling = req.scheduling()
    if kv is not None:
        params = [kv.sampling_params(p) for p in params]
        scheduling |= kv.scheduling()
    gen = Generation.for_request(ctx, prefix, arrival_time, req, raw)
    echo_scored = bool(req.echo) and req.logprobs is not None
    await gen.submit(
        token_prompts, params, scheduling, "logprobs" if echo_scored else "prompt_logprobs"
    )
    return gen, token_prompts


class _Echo:
    """A prompt as a choice echoes it: its text (the text sent, or its token ids decoded) and,
    when scored, where each of its tokens starts in that text."""

    def __init__(
        self,
        tok: Tokenizer,
        prompt: str | list[int],
        token_ids: list[int],
        special: bool,
        with_offsets: bool,
    ) -> None:
        self.tok = tok
        self.prompt = prompt
        self.token_ids = token_ids
        self.special = special
        self.with_offsets = with_offsets
        self.text = ""
        self.offsets: list[int] = []

    def render(self) -> None:
        """Token ids are known to be in the vocabulary by now (the engine took them)."""
        p, tok = self.prompt, self.tok
        if isinstance(p, str):
            self.text = p
            if self.with_offsets:
                self.offsets = tok.token_offsets(p, self.special)
        else:
            self.text = tok.decode(p)
            if self.with_offsets:
                self.offsets = TextOffsets(tok, [], True).add(p)
        # A prompt truncated to its last tokens echoes whole: its tokens' offsets are the last.
        self.offsets = self.offsets[len(self.offsets) - len(self.token_ids) :]


class _Formatter:
    """Builds OpenAI `text_completion` objects from engine outputs."""

    def __init__(
        self,
        gen: Generation,
        model: str,
        tok: Tokenizer,
        req: CompletionRequest,
        echoes: list[_Echo],
    ) -> None:
        self.gen = gen
        self.tok = tok
        self.echo = bool(req.echo)
        self.echoes = echoes
        self.top_n = req.logprobs  # None: no legacy logprobs
        self.prompt_top_n = req.prompt_logprobs  # None: no vLLM prompt_logprobs
        skip = req.skip_special_tokens is not False
        # Where each choice's generated tokens start in its text, token by token.
        self.offsets = [
            TextOffsets(tok, e.token_ids[-5:], skip, len(e.text) if self.echo else 0)
            for e in echoes
        ]
        self.head = {
            "id": gen.request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
        }

    def _logprobs(self, index: int, out: RequestOutput, token_ids, entries, first: bool):
        """The legacy logprobs of these generated tokens, after the echoed prompt's when
        `first`."""
        if self.top_n is None:
            return None
        generated = None
        if entries is not None:
            offsets = self.offsets[index].add(token_ids)
            generated = legacy_logprobs(self.tok, token_ids, entries, offsets, self.top_n)
        if not (first and self.echo) or out.prompt_logprobs is None:
            return generated
        echo = self.echoes[index]
        prompt = legacy_logprobs(
            self.tok, echo.token_ids, out.prompt_logprobs, echo.offsets, self.top_n
        )
        return join(prompt, generated)

    def _choice(self, index: int, out: RequestOutput, text: str, logprobs) -> dict:
        c = out.outputs[0]
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if self.prompt_top_n is not None and out.prompt_logprobs is not None:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(
                self.tok,
                self.echoes[index].token_ids,
                out.prompt_logprobs,
                out.prompt_logprob_ranks,
                self.prompt_top_n,
            )
        return choice

    async def collect(self) -> dict:
        async for _ in self.gen.outputs():
            pass
        choices = []
        for index in range(self.gen.num_choices):
            out = self.gen.finished[index]
            c = out.outputs[0]
            text = (self.echoes[index].text if self.echo else "") + c.text
            logprobs = self._logprobs(index, out, c.token_ids, c.logprobs, True)
            choices.append(self._choice(index, out, text, logprobs))
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
            if chunk is None:
                continue
            started.add(index)
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
        text = (self.echoes[index].text if first and self.echo else "") + c.delta_text
        logprobs = self._logprobs(index, out, c.delta_token_ids, c.delta_logprobs, first)
        if not text and logprobs is None and not c.finished:
            return None  # text held back (a stop string may be forming): nothing to send yet
        return {**self.head, "choices": [self._choice(index, out, text, logprobs)]}
