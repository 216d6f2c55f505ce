"""Pooling: a request that asks for its prompt's hidden states pooled into one vector (an
embedding) instead of new tokens.

The request is a prompt computed and nothing generated (`max_tokens` 0, as a scored prompt),
with `SamplingParams.pooling` saying how to pool. It crosses the seam as plan data: each chunk
of its prompt names the pooling (`SeqPlan.pooling`) and the executor returns what the chunk's
rows give (`StepResult.pooled`): their sum and count for "mean", the first row for "cls", the
last prompt row for "last". The final hidden states are taken after the model's last norm, as
a model's `last_hidden_state` is. On a causal model no row depends on later tokens, so a
prompt pools chunk by chunk under the same token budget as generation; the core adds the
chunks up and `finish_embedding` makes the vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from quill.contract.errors import InvalidRequestError

POOLING_TYPES = ("mean", "cls", "last")
# What a chunk's rows give: (the sum of its rows, or the one row; how many rows).
PooledRows = tuple[list[float], int]


@dataclass(frozen=True)
class PoolingParams:
    """How to pool: `type` one of POOLING_TYPES; `normalize` to unit length (cosine-ready);
    `dimensions` keeps the first n values (Matryoshka models), before normalizing."""

    type: str = "last"
    normalize: bool = True
    dimensions: int | None = None
    # A decoder reranker's: the pooled row's logits of these tokens (its "yes" and "no")
    # instead of its hidden state.
    logit_ids: tuple[int, ...] | None = None
    # A cross-encoder's: the first row through the model's classification head (its logits
    # instead of its state); `second_segment` where the prompt's second text (token type 1)
    # begins.
    classify: bool = False
    second_segment: int | None = None

    def __post_init__(self) -> None:
        if self.classify and (self.type != "cls" or self.normalize):
            raise InvalidRequestError("classify pools the first row's logits, not normalized",
                                      "pooling")  # fmt: skip
        if self.logit_ids is not None and (self.type != "last" or self.normalize):
            raise InvalidRequestError("logit_ids pool the last row's logits, not normalized",
                                      "pooling")  # fmt: skip
        if self.type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling must be one of {', '.join(POOLING_TYPES)}, got {self.type!r}", "pooling"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError("dimensions must be at least 1", "dimensions")


def add_pooled(total: PooledRows | None, chunk: PooledRows, pooling: str) -> PooledRows:
    """The running pooled value after one more chunk's."""
    if total is None or pooling != "mean":
        return chunk  # cls comes from the first chunk, last from the last
    values, count = total
    return [a + b for a, b in zip(values, chunk[0])], count + chunk[1]


def finish_embedding(pooled: PooledRows, params: PoolingParams) -> list[float]:
    """The embedding: the mean (or the row), its first `dimensions` values, unit length when
    asked."""
    values, count = pooled
    if params.type == "mean" and count > 1:
        values = [v / count for v in values]
    if params.dimensions is not None:
        values = values[: params.dimensions]
    if params.normalize:
        norm = math.sqrt(sum(v * v for v in values))
        if norm > 0:
            values = [v / norm for v in values]
    return values
