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
from collections.abc import Callable
from typing import Literal

import numpy as np
from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from quill.contract.errors import InvalidRequestError
from quill.contract.pooling import PoolingParams
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
    pooling = ctx.pooling.params(req.dimensions, req.normalize)
    k = req.truncate_prompt_tokens
    k = ctx.max_model_len if k == -1 else k
    cut = None if k is None else (lambda ids: ids[-k:])  # vLLM keeps a prompt's last k tokens
    special = req.add_special_tokens is not False
    result = await embed(ctx, req.inputs(), pooling, raw, arrival_time, cut, special,
                         req.priority or 0)  # fmt: skip
    if isinstance(result, Response):
        return result
    vectors, tokens = result
    data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
            for i, v in enumerate(vectors)]  # fmt: skip
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": model, "usage": usage}


async def embed(
    ctx: ServerContext,
    inputs: list[str | list[int]],
    pooling: PoolingParams | list[PoolingParams],
    raw: Request,
    arrival_time: float,
    cut: Callable[[list[int]], list[int]] | None = None,
    special: bool = True,
    priority: int = 0,
    names: dict[str, str] = _PARAMS,
    prefix: str = "embd",
) -> tuple[list[list[float]], int] | Response:
    """The one way inputs become pooled vectors, whichever API asked (OpenAI's and Ollama's
    embeddings, the scoring routes): each input one pooling request (`pooling` one for all or
    one an input; `cut` shortens its token ids), all batched with whatever else runs; the
    engine's errors name the fields as `names` map them. Returns the vectors in input order
    and the prompt tokens, or the response a disconnected client gets."""
    tok = ctx.tokenizer
    for text in inputs:
        if isinstance(text, str):
            if cut is None:
                ctx.check_prompt_length(text, "input")
            if not text:
                raise InvalidRequestError("input must not be an empty string", param="input")

    def tokenized() -> list[list[int]]:
        ids = [tok.encode(t, special) if isinstance(t, str) else t for t in inputs]
        return ids if cut is None else [cut(i) for i in ids]

    prompts = await asyncio.to_thread(tokenized)
    each = pooling if isinstance(pooling, list) else [pooling]
    params = [SamplingParams(max_tokens=0, pooling=p) for p in each]
    gen = Generation(
        ctx, ctx.request_id(prefix), arrival_time, None, raw.headers.get("x-request-id")
    )
    try:
        await gen.submit(prompts, params, {"priority": priority}, zipped=len(params) > 1)
    except InvalidRequestError as e:
        raise renamed(e, names) from None
    except APIError as e:
        raise (renamed(e, names) if e.status_code < 500 else e) from None

    async def collect() -> tuple[list[list[float]], int]:
        async for _ in gen.outputs():
            pass
        return [gen.finished[i].embedding for i in range(len(prompts))], sum(gen.prompt_lens)

    return await unless_disconnected(raw, gen, collect)
