"""A request's prompt as the replicas' prefix cache names it: its full blocks' hashes.

The cache-aware policy compares these with the blocks each replica holds (its KV-cache
events). The prompt must be the tokens the replica will compute, so the router renders a chat
as the replica's front end does (the same module: quill/server/chat.prepare, with the same
model's tokenizer and template) and hashes blocks with the engine's own function
(quill/engine/kv_cache.py). A request the router cannot render (a bad body: the replica will
refuse it with a 400) has no blocks and goes by load.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from quill.contract.errors import InvalidRequestError
from quill.engine.kv_cache import BlockHasher, chain_root, hash_block
from quill.frontend.chat import ChatFormat
from quill.frontend.json_limits import JsonLimits
from quill.frontend.tokenizer import Tokenizer
from quill.server.chat import prepare
from quill.server.protocol import ChatCompletionRequest

log = logging.getLogger(__name__)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"


@dataclass
class _Front:
    """What quill.server.chat.prepare reads of a server's context."""

    tokenizer: Tokenizer
    chat_format: ChatFormat


def prefix_hashes(
    token_ids: list[int],
    block_size: int,
    cache_salt: str | None = None,
    hasher: BlockHasher = hash_block,
) -> list:
    """The hashes of the full blocks of `token_ids`, as the engine (hashing with `hasher`)
    names them."""
    parent, out = chain_root(cache_salt), []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hasher(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out


class PromptBlocks:
    """Renders and tokenizes requests for one model, as its replicas do."""

    def __init__(self, model: str, chat_template_kwargs: dict | None = None) -> None:
        self.tokenizer = Tokenizer.load(Path(model))
        self.front = _Front(
            self.tokenizer,
            ChatFormat.choose(
                self.tokenizer.hf.chat_template, template_kwargs=chat_template_kwargs
            ),
        )
        self.limits = JsonLimits()

    def token_ids(self, path: str, body: dict) -> list[int] | None:
        """The prompt's tokens (the first prompt's, for a batch); None where not known."""
        try:
            if path == CHAT:
                return self._chat(body)
            if path == COMPLETIONS:
                return self._completion(body)
        except (ValidationError, InvalidRequestError, ValueError, TypeError) as e:
            log.debug("no prompt blocks for a request the replica will judge: %s", e)
        return None

    def hashes(self, path: str, body: dict, block_size: int) -> list[bytes]:
        ids = self.token_ids(path, body)
        if not ids:
            return []
        salt = body.get("cache_salt")
        return prefix_hashes(ids, block_size, salt if isinstance(salt, str) else None)

    def _chat(self, body: dict) -> list[int]:
        req = ChatCompletionRequest.model_validate(body, context={"limits": self.limits})
        return prepare(self.front, req).prompt_ids

    def _completion(self, body: dict) -> list[int] | None:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]  # a batch: its first prompt stands for it
        if body.get("suffix") is not None:
            return None  # an infill's prompt is rebuilt around the suffix
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, body.get("add_special_tokens") is not False)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return None
