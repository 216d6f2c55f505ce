"""Reranking and scoring: `POST /v1/rerank` (also `/rerank` and `/v2/rerank`: the Jina /
Cohere shape Open WebUI and the RAG frameworks send) and `POST /v1/score` (also `/score`:
vLLM's pairs of texts).

Rerank: `query`, `documents` (texts, or objects with `text`), `top_n`, `return_documents`;
results sorted by `relevance_score`, each with its `index` in the documents. Score:
`text_1` and `text_2`, each a text or a list (one against many, or pairwise). How a pair is
scored is the model's (quill/frontend/scoring.py): a cross-encoder's head, a decoder
reranker's P(yes), or the cosine of an embedding model's vectors. `instruction`
(Qwen3-Reranker's "Instruct") is quill's.
"""

from __future__ import annotations

import asyncio
import time

from pydantic import Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from quill.contract.errors import InvalidRequestError
from quill.server.context import ServerContext
from quill.server.embeddings import embed
from quill.server.errors import APIError
from quill.server.fields import INT64_MAX, Lenient


class RerankDocument(Lenient):
    text: str


class RerankRequest(Lenient):
    model: str | None = None
    query: str = Field(min_length=1)
    documents: list[str | RerankDocument] = Field(min_length=1)
    top_n: int | None = Field(None, ge=1, le=INT64_MAX)
    return_documents: bool | None = True
    instruction: str | None = None

    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class ScoreRequest(Lenient):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    instruction: str | None = None

    @model_validator(mode="after")
    def _check(self):
        for name in ("text_1", "text_2"):
            value = getattr(self, name)
            if isinstance(value, list) and not value:
                raise InvalidRequestError(f"{name} must not be empty", param=name)
        if isinstance(self.text_1, list) and len(self.text_1) > 1:
            if not isinstance(self.text_2, list) or len(self.text_2) != len(self.text_1):
                raise InvalidRequestError("with several text_1, text_2 must be a list of as "
                                          "many (scored pairwise)", param="text_2")  # fmt: skip
        return self

    def pairs(self) -> list[tuple[str, str]]:
        firsts = [self.text_1] if isinstance(self.text_1, str) else self.text_1
        seconds = [self.text_2] if isinstance(self.text_2, str) else self.text_2
        if len(firsts) == 1:
            return [(firsts[0], s) for s in seconds]
        return list(zip(firsts, seconds))


async def _score(
    ctx: ServerContext, req, raw: Request, arrival_time: float, pairs, param: str
) -> tuple[list[float], int]:
    """Each pair's score, and the prompt tokens it took."""
    scorer = ctx.scorer
    if scorer is None:
        raise APIError(400, "this model scores nothing: serve an embedding model, or a reranker "
                       "with --task score", param="model")  # fmt: skip
    for q, d in pairs:
        ctx.check_prompt_length(q + d, param)
    inputs = await asyncio.to_thread(scorer.inputs, ctx.tokenizer, pairs, req.instruction)
    result = await embed(ctx, [ids for ids, _ in inputs], [p for _, p in inputs], raw,
                         arrival_time, names={"prompt": param, "n": param},
                         prefix="score")  # fmt: skip
    if isinstance(result, Response):
        return result, 0  # the client left
    pooled, tokens = result
    return scorer.scores(pairs, pooled), tokens


async def create_rerank(ctx: ServerContext, req: RerankRequest, raw: Request, t: float):
    model = ctx.check_model(req.model)
    documents = req.texts()
    scores, tokens = await _score(ctx, req, raw, t, [(req.query, d) for d in documents],
                                  "documents")  # fmt: skip
    if not isinstance(scores, list):
        return scores  # the client left
    order = sorted(range(len(documents)), key=lambda i: -scores[i])[: req.top_n]
    results = []
    for i in order:
        result = {"index": i, "relevance_score": scores[i]}
        if req.return_documents is not False:
            result["document"] = {"text": documents[i]}
        results.append(result)
    return {"id": ctx.request_id("rerank"), "model": model, "results": results,
            "usage": {"total_tokens": tokens}}  # fmt: skip


async def create_score(ctx: ServerContext, req: ScoreRequest, raw: Request, t: float):
    model = ctx.check_model(req.model)
    scores, tokens = await _score(ctx, req, raw, t, req.pairs(), "text_2")
    if not isinstance(scores, list):
        return scores
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return {"id": ctx.request_id("score"), "object": "list", "created": int(time.time()),
            "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}  # fmt: skip
