"""Incremental detokenization with stop strings.

A token can end in the middle of a multi-byte UTF-8 character, and tokenizers that mark word
starts (SentencePiece's "▁") only render a space when the token has a left neighbour. So each new
token is decoded together with a few tokens before it, and text is released only once it no
longer ends in a replacement character. For streaming, the last `len(longest stop) - 1`
characters are held back, since they could be the start of a stop string that the next token
completes.
"""

from __future__ import annotations

from quill.frontend.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Text of one request's output, grown one token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        include_stop: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.include_stop = include_stop
        self.skip_special_tokens = skip_special_tokens
        self.holdback = max((len(s) for s in stop), default=1) - 1
        context = prompt_token_ids[-_CONTEXT_TOKENS:]
        self.tokens: list[int] = list(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self.text = ""
        self.num_emitted_chars = 0

    def add_token(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if the text now contains one (text cut after
        it, or before it unless include_stop)."""
        self.tokens.append(token_id)
        skip = self.skip_special_tokens
        prefix = self.tokenizer.decode(self.tokens[self.prefix_offset : self.read_offset], skip)
        full = self.tokenizer.decode(self.tokens[self.prefix_offset :], skip)
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return None  # an incomplete character: wait for the next token
        new_text = full[len(prefix) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        search_from = max(0, len(self.text) - self.holdback)
        self.text += new_text
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, search_from)) != -1]
        if not hits:
            return None
        idx, stop = min(hits)
        self.text = self.text[: idx + len(stop) if self.include_stop else idx]
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out; while running, keep back what could begin a stop string."""
        end = len(self.text) if finished else max(0, len(self.text) - self.holdback)
        if end <= self.num_emitted_chars:
            return ""
        delta = self.text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
