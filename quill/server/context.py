"""What every route needs: the engine bridge, the metrics, the served names and the limits."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from quill.frontend.chat import ChatFormat
from quill.frontend.json_limits import JsonLimits
from quill.frontend.pooling_config import PoolingConfig
from quill.frontend.scoring import Scorer
from quill.frontend.tokenizer import Tokenizer
from quill.server.engine_client import EngineClient
from quill.server.errors import APIError
from quill.server.metrics import ServerMetrics


@dataclass
class ServerContext:
    engine: EngineClient
    metrics: ServerMetrics
    served_model_names: list[str]
    api_key: str | None = None
    # Limits: sequences waiting (every prompt x n counts), sequences one request may add,
    # prompt tokens one request may have scored (each an entry of its reply), body bytes, and
    # seconds a body may stall.
    max_queued_requests: int | None = None
    max_seqs_per_request: int = 256
    max_prompt_logprobs_tokens: int = 16384
    max_request_bytes: int = 4 << 20
    # Bounds on the JSON inside a request's fields: schemas, tools, call arguments, grammars.
    json_limits: JsonLimits = field(default_factory=JsonLimits)
    request_body_timeout: float = 30.0
    # Stored responses of the Responses API: bytes kept, and seconds each is kept.
    responses_store_bytes: int = 256 << 20
    responses_store_ttl: float = 86400.0
    metrics_require_key: bool = False
    enable_api_docs: bool = False
    # Disaggregation (quill/server/kv_transfer.py): "prefill", "decode" or "both" (whole
    # requests only), and how long a prefill instance keeps a prompt's KV for its decode one.
    role: str = "both"
    kv_lease_s: float = 30.0
    # The console page (quill/server/console) and the directories whose figures it links.
    console: bool = True
    console_figures: list[Path] = field(default_factory=list)
    # How the model's conversations are written and its replies read (tools, reasoning).
    chat_format: ChatFormat = field(default_factory=ChatFormat)
    # How the model pools its embeddings by default (quill/frontend/pooling_config.py).
    pooling: PoolingConfig = field(default_factory=PoolingConfig)
    # How pairs are scored for /v1/rerank and /v1/score (None: this model scores nothing).
    scorer: Scorer | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    @property
    def tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

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

    def check_capacity(self, num_seqs: int, param: str = "n") -> None:
        """Room for `num_seqs` more sequences: 400 past the per-request bound, 503 with
        Retry-After when the waiting queue cannot take them or the engine is gone."""
        if num_seqs > self.max_seqs_per_request:
            raise APIError(
                400,
                f"This request asks for {num_seqs} sequences (prompts x n); the server accepts at "
                f"most {self.max_seqs_per_request} per request (--max-seqs-per-request).",
                param=param,
            )
        if not self.engine.is_alive:
            raise APIError(503, "The server is not serving requests.", "server_error")
        limit = self.max_queued_requests
        if limit is not None and num_seqs > limit:
            raise APIError(
                400,
                f"This request asks for {num_seqs} sequences (prompts x n), more than the "
                f"{limit} the server lets wait at once (--max-queued-requests).",
                param=param,
            )
        waiting = self.engine.num_waiting()
        if limit is not None and waiting + num_seqs > limit:
            raise APIError(
                503,
                f"The server is overloaded: {waiting} sequences are waiting and {limit} may; "
                f"this request adds {num_seqs}. Please retry after a short wait.",
                "server_error",
                code="overloaded",
                headers={"Retry-After": "1"},
            )

    def check_prompt_logprobs(self, num_tokens: int, param: str) -> None:
        """400 when a request asks for the logprobs of more prompt tokens than the bound: the
        reply would hold an entry for each (and the engine the logits of each row)."""
        if num_tokens > self.max_prompt_logprobs_tokens:
            raise APIError(
                400,
                f"This request asks for the logprobs of {num_tokens} prompt tokens (its prompts "
                f"x n); the server scores at most {self.max_prompt_logprobs_tokens} a request "
                "(--max-prompt-logprobs-tokens).",
                param=param,
            )

    @staticmethod
    def request_id(prefix: str) -> str:
        """A request's id, the server's own and unique: a client's X-Request-Id is only
        echoed back and logged (quill/server/guard.py), so that no client can name, and so
        abort or collide with, another client's request."""
        return f"{prefix}-{uuid.uuid4().hex}"

    def check_prompt_length(self, text: str, param: str = "prompt") -> None:
        """Refuse, before tokenizing it, a text too long to fit the context in any tokenization.

        No token covers more than `max_token_chars` characters, so a text of more than
        max_model_len * max_token_chars characters has more than max_model_len tokens.
        """
        bound = self.max_model_len * self.tokenizer.max_token_chars
        if len(text) > bound:
            raise APIError(
                400,
                f"The prompt has {len(text)} characters, more than the {self.max_model_len} "
                f"tokens of this model's context can hold (at most {bound} characters).",
                param=param,
            )
