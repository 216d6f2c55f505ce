"""POST /v1/embeddings: each input's embedding, OpenAI's shape.

`input` is a text, a list of texts, token ids, or lists of token ids (LangChain's
OpenAIEmbeddings sends token ids by default); `encoding_format` float or base64 (little-endian
float32, as the `openai` client decodes it); `dimensions` where the model was trained for
shorter vectors; vLLM's `normalize` and `truncate_prompt_tokens`. Each input is one pooling
request to the engine (quill/contract/pooling.py), batched with whatever else runs.
"""

from __future__ import annotations

import asyncio
import base64
from typing import Literal

import numpy as np
from pydantic import Field, model_validator
from starlette.requests import Request

from quill.contract.errors import InvalidRequestError
from quill.contract.sampling_params import SamplingParams
from quill.server.context import ServerContext
from quill.server.errors import APIError, renamed
from quill.server.fields import INT64_MAX, Int64, Lenient
from quill.server.generation import Generation, unless_disconnected

# The engine's names for the fields, as this API names them.
_PARAMS = {"prompt": "input", "max_tokens": "input"}


class EmbeddingRequest(Lenient):
    model: str | None = None
    input: str | list[str] | list[Int64] | list[list[Int64]]
    encoding_format: Literal["float", "base64"] | None = "float"
    dimensions: int | None = Field(None, ge=1, le=INT64_MAX)
    user: str | None = None
    # vLLM's extensions.
    normalize: bool | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    add_special_tokens: bool | None = True
    priority: Int64 | None = 0

    @model_validator(mode="after")
    def _check(self):
        if isinstance(self.input, list) and (
            not self.input or any(isinstance(i, list) and not i for i in self.input)
        ):
            raise InvalidRequestError("input must not be empty", param="input")
        if self.truncate_prompt_tokens == 0:
            raise InvalidRequestError("truncate_prompt_tokens must be -1 or at least 1",
                                      param="truncate_prompt_tokens")  # fmt: skip
        return self

    def inputs(self) -> list[str | list[int]]:
        value = self.input
        if isinstance(value, str):
            return [value]
        if all(isinstance(t, int) for t in value):
            return [value]  # one input given as token ids
        return list(value)


def _encode(vector: list[float], encoding: str | None) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()
    return vector


async def create_embedding(
    ctx: ServerContext, req: EmbeddingRequest, raw: Request, arrival_time: float
) -> dict:
    model = ctx.check_model(req.model)
    tok = ctx.tokenizer
    inputs = req.inputs()
    for text in inputs:
        if isinstance(text, str):
            ctx.check_prompt_length(text, "input")
            if not text:
                raise InvalidRequestError("input must not be an empty string", param="input")
    pooling = ctx.pooling.params(req.dimensions, req.normalize)

    def tokenized() -> list[list[int]]:
        special = req.add_special_tokens is not False
        ids = [tok.encode(t, special) if isinstance(t, str) else t for t in inputs]
        k = req.truncate_prompt_tokens
        if k is not None:
            k = ctx.max_model_len if k == -1 else k
            ids = [i[-k:] for i in ids]
        return ids

    prompts = await asyncio.to_thread(tokenized)
    params = SamplingParams(max_tokens=0, pooling=pooling)
    gen = Generation(
        ctx, ctx.request_id("embd"), arrival_time, None, raw.headers.get("x-request-id")
    )
    try:
        await gen.submit(prompts, [params], {"priority": req.priority or 0})
    except InvalidRequestError as e:
        raise renamed(e, _PARAMS) from None
    except APIError as e:
        raise (renamed(e, _PARAMS) if e.status_code < 500 else e) from None

    async def collect() -> dict:
        async for _ in gen.outputs():
            pass
        data = [
            {"object": "embedding", "index": i,
             "embedding": _encode(gen.finished[i].embedding, req.encoding_format)}
            for i in range(len(prompts))
        ]  # fmt: skip
        tokens = sum(gen.prompt_lens)
        usage = {"prompt_tokens": tokens, "total_tokens": tokens}
        return {"object": "list", "data": data, "model": model, "usage": usage}

    return await unless_disconnected(raw, gen, collect)
