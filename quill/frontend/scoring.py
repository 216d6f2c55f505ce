"""Scoring (query, document) pairs, for reranking: how the served model scores them.

Two ways, by what the model is:
- a decoder reranker (Qwen3-Reranker; `--task score` on a causal model): the pair written in
  the reranker's prompt, and the score the probability of "yes" against "no" at the end of it
  (the last row's logits of the two tokens, pooled by the engine: PoolingParams.logit_ids);
- an embedding model (a bi-encoder such as all-MiniLM-L6-v2, or `--task embed`): the cosine
  of the two texts' embeddings, as vLLM's score API gives for embedding models.
Each is engine pooling requests (quill/contract/pooling.py); the scores are computed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quill.contract.errors import InvalidRequestError
from quill.contract.pooling import PoolingParams
from quill.frontend.pooling_config import PoolingConfig
from quill.frontend.tokenizer import Tokenizer

# Qwen3-Reranker's prompt, as its model card writes it.
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct "
    'provided. Note that the answer can only be "yes" or "no".'
)
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
_PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


@dataclass(frozen=True)
class Scorer:
    """`kind` "yes_no" (a decoder reranker) or "cosine" (an embedding model); `pooling` the
    embedding model's own."""

    kind: str
    pooling: PoolingParams
    yes_no: tuple[int, int] | None = None  # the reranker's token ids

    @classmethod
    def for_model(cls, task: str, tokenizer: Tokenizer, pooling: PoolingParams) -> Scorer:
        if task != "score":
            return cls("cosine", pooling)
        ids = []
        for word in ("yes", "no"):
            encoded = tokenizer.encode(word, False)
            if len(encoded) != 1:
                raise InvalidRequestError(f"a reranker needs {word!r} as one token of its "
                                          "vocabulary", "model")  # fmt: skip
            ids.append(encoded[0])
        yes_no = (ids[0], ids[1])
        return cls("yes_no", PoolingParams("last", normalize=False, logit_ids=yes_no), yes_no)

    def texts(self, pairs: list[tuple[str, str]], instruction: str | None) -> list[str]:
        """The texts to pool: for a reranker one prompt a pair; for an embedding model each
        distinct text once (a query scored against many documents is embedded once)."""
        if self.kind == "yes_no":
            task = instruction or RERANK_INSTRUCTION
            return [f"{_PREFIX}<Instruct>: {task}\n<Query>: {q}\n<Document>: {d}{_SUFFIX}"
                    for q, d in pairs]  # fmt: skip
        return list(dict.fromkeys(t for pair in pairs for t in pair))

    def encode(self, tokenizer: Tokenizer, text: str) -> list[int]:
        # The reranker's prompt carries its own markers; an embedding model's text its BOS/CLS.
        return tokenizer.encode(text, self.kind != "yes_no")

    def scores(self, pairs: list[tuple[str, str]], texts: list[str], pooled: list) -> list[float]:
        """Each pair's score from what the engine pooled for `texts`."""
        if self.kind == "yes_no":  # P(yes) over yes and no
            return [1 / (1 + math.exp(no - yes)) for yes, no in pooled]
        vectors = dict(zip(texts, pooled))
        return [_cosine(vectors[q], vectors[d]) for q, d in pairs]


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def scorer_for(task: str, tokenizer: Tokenizer, pooling: PoolingConfig) -> Scorer | None:
    """How a model served for `task` (quill.config.resolve_task) scores pairs: a reranker's
    yes / no (score), an embedding model's cosine (embed); a generating model scores nothing,
    nor one whose embeddings quill cannot make."""
    if task == "generate" or pooling.unsupported:
        return None
    return Scorer.for_model(task, tokenizer, pooling.params(None, None))
