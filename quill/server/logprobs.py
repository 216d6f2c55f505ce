"""Logprobs as the APIs write them: OpenAI's legacy completions format and vLLM's prompt_logprobs.

The legacy format (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) covers echoed
prompt tokens too: the first has no logprob (null), as in OpenAI's API and vLLM, and each
token's `text_offset` is where its text starts in the choice's text. Offsets come from the
text itself, not from adding up token strings (a token that ends inside a multi-byte character
has no text of its own; a special token may be left out of the text): a prompt sent as text
takes the tokenizer's own offsets into it, token ids and generated tokens the incremental
detokenizer's growing text.
"""

from __future__ import annotations

from quill.contract.outputs import TokenLogprobs
from quill.frontend.detokenizer import IncrementalDetokenizer
from quill.frontend.tokenizer import Tokenizer
from quill.server.generation import json_logprob, token_text


class TextOffsets:
    """Where each token's text starts in the text the tokens decode to, token by token: a
    token whose text waits for the next one (a character split over both) starts where that
    character does."""

    def __init__(
        self, tok: Tokenizer, context: list[int], skip_special_tokens: bool, start: int = 0
    ) -> None:
        self.detok = IncrementalDetokenizer(tok, context, [], False, skip_special_tokens)
        self.start = start  # where the text begins in the choice's text

    def add(self, token_ids: list[int]) -> list[int]:
        offsets = []
        for token in token_ids:
            offsets.append(self.start + len(self.detok.text))
            self.detok.add_token(token)
        return offsets


def top_entries(entry: TokenLogprobs, token_id: int, top_n: int) -> list[tuple[int, float]]:
    """The `top_n` most likely tokens of a position, and the token there if not among them,
    most likely first."""
    ranked = sorted(entry.items(), key=lambda kv: -kv[1])
    kept = ranked[:top_n]
    if all(t != token_id for t, _ in kept):
        kept.append((token_id, entry[token_id]))
    return kept


def legacy_logprobs(
    tok: Tokenizer,
    token_ids: list[int],
    entries: list[TokenLogprobs | None],
    offsets: list[int],
    top_n: int,
) -> dict:
    """OpenAI's legacy `logprobs` object for these tokens (an entry None: the first prompt
    token's, which nothing predicts)."""
    tokens, chosen, top = [], [], []
    for tid, entry in zip(token_ids, entries):
        tokens.append(token_text(tok, tid))
        if entry is None:
            chosen.append(None)
            top.append(None)
            continue
        chosen.append(json_logprob(entry.get(tid)))
        kept = top_entries(entry, tid, top_n)
        top.append({token_text(tok, t): json_logprob(lp) for t, lp in kept})
    return {
        "tokens": tokens,
        "token_logprobs": chosen,
        "top_logprobs": top,
        "text_offset": list(offsets),
    }


def join(first: dict | None, second: dict | None) -> dict | None:
    """Two legacy logprobs objects as one (the echoed prompt's, then the generated tokens')."""
    if first is None or second is None:
        return first or second
    return {key: first[key] + second[key] for key in first}


def vllm_prompt_logprobs(
    tok: Tokenizer,
    token_ids: list[int],
    entries: list[TokenLogprobs | None],
    ranks: list[int | None],
    top_n: int,
) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {"logprob",
    "rank", "decoded_token"}} for the top n there and the prompt token."""
    out: list[dict | None] = []
    for tid, entry, rank in zip(token_ids, entries, ranks):
        if entry is None:
            out.append(None)
            continue
        item = {}
        for place, (t, lp) in enumerate(top_entries(entry, tid, top_n), start=1):
            item[str(t)] = {
                "logprob": json_logprob(lp),
                "rank": rank if t == tid else place,
                "decoded_token": token_text(tok, t),
            }
        out.append(item)
    return out


def token_logprobs(
    tok: Tokenizer, token_ids: list[int], entries: list[TokenLogprobs], top_n: int
) -> list[dict]:
    """OpenAI's per-token logprobs (chat completions' `logprobs.content`, the Responses API's
    `output_text.logprobs`): each token's text, logprob and bytes, and its top `top_n`."""

    def token(token_id: int, logprob: float | None) -> dict:
        text = token_text(tok, token_id)
        return {"token": text, "logprob": json_logprob(logprob), "bytes": list(text.encode())}

    out = []
    for tid, entry in zip(token_ids, entries):
        ranked = sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
        out.append({**token(tid, entry.get(tid)),
                    "top_logprobs": [token(t, lp) for t, lp in ranked]})  # fmt: skip
    return out
