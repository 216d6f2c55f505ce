"""POST /infill: llama-server's code-infill endpoint (llama.vscode, Continue's llama.cpp
provider): `input_prefix`, `input_suffix`, other files as `input_extra`, laid out in the
model's FIM tokens (quill/frontend/infill.py); the reply in llama-server's completion shape
(`content`, `stop`, `stop_type`, `tokens_predicted`, `tokens_evaluated`, `timings`), streamed as
server-sent events of the same objects.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from quill.frontend.infill import ExtraFile, infill_prompt
from quill.server.context import ServerContext
from quill.server.fields import Lenient
from quill.server.generation import Generation, unless_disconnected
from quill.server.protocol import SamplingRequest

_DEFAULT_MAX_TOKENS = 128  # llama.vscode asks for its own; a bare request gets a line or two


class InputFile(Lenient):
    filename: str = ""
    text: str


class InfillRequest(SamplingRequest):
    input_prefix: str = ""
    input_suffix: str = ""
    input_extra: list[InputFile] | None = None
    prompt: str = ""  # llama-server: text after the middle token (the start of the middle)
    # llama.cpp's names for max_tokens (-1: no cap) and repetition_penalty.
    n_predict: int | None = Field(None, ge=-1)
    repeat_penalty: float | None = Field(None, gt=0)

    @model_validator(mode="after")
    def _llama_names(self):
        if self.n_predict is not None and self.max_tokens is None:
            self.max_tokens = None if self.n_predict == -1 else self.n_predict
        if self.repeat_penalty is not None and self.repetition_penalty is None:
            self.repetition_penalty = self.repeat_penalty
        return self


async def create_infill(
    ctx: ServerContext, req: InfillRequest, raw: Request, arrival_time: float
) -> Response | dict:
    model = ctx.check_model(req.model)
    tok = ctx.tokenizer
    for name in ("input_prefix", "input_suffix", "prompt"):
        ctx.check_prompt_length(getattr(req, name), name)
    extra = [ExtraFile(f.filename, f.text) for f in req.input_extra or []]
    ctx.check_prompt_length("".join(f.text for f in extra), "input_extra")

    def encode() -> list[int]:
        ids = infill_prompt(tok, req.input_prefix, req.input_suffix, extra,
                            param="input_prefix")  # fmt: skip
        ids += tok.encode(req.prompt, add_special_tokens=False) if req.prompt else []
        return req.truncate(ids, ctx.max_model_len)

    prompt = await asyncio.to_thread(encode)
    default = None if req.n_predict == -1 else _DEFAULT_MAX_TOKENS
    params = req.sampling_params(default, None, 0)
    gen = Generation.for_request(ctx, "infill", arrival_time, req, raw)
    await gen.submit([prompt], [params], req.scheduling())
    if req.stream:
        return StreamingResponse(_stream(gen, model), media_type="text/event-stream")
    return await unless_disconnected(raw, gen, lambda: _collect(gen, model))


async def _collect(gen: Generation, model: str) -> dict:
    async for _ in gen.outputs():
        pass
    out = gen.finished[0]
    return {"content": out.outputs[0].text, **_final(gen, model)}


async def _stream(gen: Generation, model: str) -> AsyncIterator[str]:
    try:
        async for _, out in gen.outputs():
            c = out.outputs[0]
            if c.delta_text:
                yield _event({"content": c.delta_text, "stop": False})
        yield _event({"content": "", **_final(gen, model)})
    except Exception as e:  # llama-server's stream error: an error object, then the end
        yield _event({"error": {"code": 500, "message": str(e), "type": "server_error"}})
    finally:
        gen.abort()


def _final(gen: Generation, model: str) -> dict:
    c = gen.finished[0].outputs[0]
    stop_type = {"stop": "eos", "length": "limit"}.get(c.finish_reason, "none")
    if isinstance(c.stop_reason, str):
        stop_type = "word"
    t = gen.timings()
    prompt_n, predicted_n = gen.prompt_lens[0], gen.num_generated.get(0, 0)
    prompt_s, decode_s = t["prefill_time"] or 0.0, t["decode_time"] or 0.0
    return {
        "stop": True,
        "model": model,
        "stop_type": stop_type,
        "stopping_word": c.stop_reason if isinstance(c.stop_reason, str) else "",
        "tokens_predicted": predicted_n,
        "tokens_evaluated": prompt_n,
        "tokens_cached": gen.cached_tokens(),
        "timings": {
            "prompt_n": prompt_n,
            "prompt_ms": prompt_s * 1e3,
            "predicted_n": predicted_n,
            "predicted_ms": decode_s * 1e3,
            "predicted_per_second": (predicted_n - 1) / decode_s if decode_s > 0 else None,
        },
    }


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"
