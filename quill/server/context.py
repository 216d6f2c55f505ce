"""What every route needs: the engine bridge, the metrics, the served names and the limits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from quill.engine.tokenizer import Tokenizer
from quill.server.async_engine import AsyncEngine
from quill.server.errors import APIError
from quill.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: AsyncEngine
    metrics: ServerMetrics
    served_model_names: list[str]
    api_key: str | None = None
    max_queued_requests: int | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    def check_model(self, name: str | None) -> str:
        """The served name a request asked for (the first one when it named none); 404 else."""
        if name is None:
            return self.model_name
        if name not in self.served_model_names:
            raise APIError(
                404,
                f"The model `{name}` does not exist.",
                param="model",
                code="model_not_found",
            )
        return name

    def check_capacity(self) -> None:
        """503 with Retry-After when the waiting queue is full or the engine is gone."""
        if not self.engine.is_alive:
            raise APIError(503, "The server is not serving requests.", "server_error")
        limit = self.max_queued_requests
        if limit is not None and self.engine.num_waiting() >= limit:
            raise APIError(
                503,
                f"The server is overloaded: {limit} requests are already waiting. "
                "Please retry after a short wait.",
                "server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )
