"""Scoring (query, document) pairs, for reranking: how the served model scores them.

Three ways, by what the model is:
- a cross-encoder (BertForSequenceClassification: ms-marco-MiniLM and kin): both texts as one
  input, its classification head's logit on the first row through a sigmoid;
- a decoder reranker (Qwen3-Reranker; `--task score` on a causal model): the pair written in
  the reranker's prompt, and the score the probability of "yes" against "no" at the end of it
  (the last row's logits of the two tokens, pooled by the engine: PoolingParams.logit_ids);
- an embedding model (a bi-encoder such as all-MiniLM-L6-v2, or `--task embed`): the cosine
  of the two texts' embeddings, as vLLM's score API gives for embedding models.
Each is engine pooling requests (quill/contract/pooling.py); the scores are computed here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

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
    """`kind` "yes_no" (a decoder reranker), "cross_encoder" (a classification head on both
    texts at once) or "cosine" (an embedding model, `pooling` its own)."""

    kind: str
    pooling: PoolingParams
    yes_no: tuple[int, int] | None = None  # the reranker's token ids

    @classmethod
    def for_model(cls, kind: str, tokenizer: Tokenizer, pooling: PoolingParams) -> Scorer:
        if kind == "cross_encoder":
            return cls(kind, PoolingParams("cls", normalize=False, classify=True))
        if kind != "yes_no":
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

    def inputs(
        self, tokenizer: Tokenizer, pairs: list[tuple[str, str]], instruction: str | None
    ) -> list[tuple[list[int], PoolingParams]]:
        """The engine's pooling requests (token ids, pooling): for a reranker one a pair (the
        pair in its prompt; a cross-encoder's two texts as one input, the second's tokens of
        type 1); for an embedding model one a distinct text (a query scored against many
        documents is embedded once)."""
        if self.kind == "cross_encoder":
            out = []
            for q, d in pairs:
                ids, second = tokenizer.encode_pair(q, d)
                out.append((ids, replace(self.pooling, second_segment=second)))
            return out
        if self.kind == "yes_no":
            task = instruction or RERANK_INSTRUCTION
            texts = [f"{_PREFIX}<Instruct>: {task}\n<Query>: {q}\n<Document>: {d}{_SUFFIX}"
                     for q, d in pairs]  # fmt: skip
            return [(tokenizer.encode(t, False), self.pooling) for t in texts]
        return [(tokenizer.encode(t), self.pooling) for t in _distinct(pairs)]

    def scores(self, pairs: list[tuple[str, str]], pooled: list[list[float]]) -> list[float]:
        """Each pair's score from what the engine pooled for `inputs`."""
        if self.kind == "yes_no":  # P(yes) over yes and no
            return [1 / (1 + math.exp(no - yes)) for yes, no in pooled]
        if self.kind == "cross_encoder":  # its one logit through a sigmoid
            if any(len(p) != 1 for p in pooled):
                raise InvalidRequestError("this cross-encoder has several labels: a "
                                          "classifier, not a reranker", "model")  # fmt: skip
            return [1 / (1 + math.exp(-p[0])) for p in pooled]
        vectors = dict(zip(_distinct(pairs), pooled))
        return [_cosine(vectors[q], vectors[d]) for q, d in pairs]


def _distinct(pairs: list[tuple[str, str]]) -> list[str]:
    return list(dict.fromkeys(t for pair in pairs for t in pair))


def _cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b))
    norm = math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b))
    return dot / norm if norm else 0.0


def scorer_for(task: str, tokenizer: Tokenizer, pooling: PoolingConfig,
               cross_encoder: bool = False) -> Scorer | None:  # fmt: skip
    """How a model served for `task` (quill.config.resolve_task) scores pairs: a
    cross-encoder's head, a decoder reranker's yes / no (score), an embedding model's cosine
    (embed); a generating model scores nothing, nor one whose embeddings quill cannot make."""
    if cross_encoder:
        return Scorer.for_model("cross_encoder", tokenizer, None)
    if task == "generate" or pooling.unsupported:
        return None
    kind = "yes_no" if task == "score" else "cosine"
    return Scorer.for_model(kind, tokenizer, pooling.params(None, None))
