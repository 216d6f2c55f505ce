"""Random prompt texts of an exact number of tokens, for a serving benchmark.

A benchmark of "1024-token prompts" should send 1024 tokens, and prompts that share nothing, so
that no prefix cache can serve part of them. Texts are made in the model's own tokenizer:

1. The candidates are the tokens that stand alone: not special, and whose text encodes back
   to that one token (this leaves out byte fragments of multi-byte characters, which decode to
   a replacement character).
2. Draw as many candidates at random as wanted, decode them to text, and encode the text.
   Neighbours may merge into one token or split at their seam, so the count can be off. Then
   keep the first n tokens of that encoding when it is too long, or add random candidates
   when it is too short, and decode and encode again, until the text encodes to exactly n.
3. If a draw does not settle in a few rounds, draw afresh; it settles in one or two rounds.

The count is the server's: tokens the tokenizer adds by itself (a BOS) are part of it, so the
text is made that many tokens shorter. Nothing is downloaded: the tokenizer is a local file.
"""

from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer

_ROUNDS = 8
_DRAWS = 20


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """A tokenizer.json file, or a model directory holding one (or one transformers can load
    without the network); the default model's when `path` is None."""
    if path is None:
        from quill.model.default_model import default_model_dir  # imports torch: only here

        path = default_model_dir()
    path = Path(path)
    file = path if path.is_file() else path / "tokenizer.json"
    if file.is_file():
        try:
            return Tokenizer.from_file(str(file))
        except Exception as e:  # the Rust side raises a bare Exception
            raise ValueError(f"could not read the tokenizer {str(file)!r}: {e}") from e
    if not path.is_dir():
        raise ValueError(f"no tokenizer at {str(path)!r}: give a tokenizer.json or its directory")
    from transformers import AutoTokenizer

    try:
        hf = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:
        raise ValueError(f"could not load a tokenizer from {str(path)!r}: {e}") from e
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{str(path)!r} has no fast tokenizer (tokenizer.json)")
    return hf.backend_tokenizer


def count_tokens(tokenizer: Tokenizer, text: str) -> int:
    """Tokens of a text as a server counts a prompt (with the tokens the tokenizer adds)."""
    return len(tokenizer.encode(text).ids)


class ExactPrompts:
    """Makes random texts that encode to exactly the number of tokens asked for."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
        self.special_ids = frozenset(special)
        self.num_added = len(tokenizer.encode("").ids)  # a BOS, say, on every prompt
        ids = [i for i in range(tokenizer.get_vocab_size(with_added_tokens=True))]
        ids = [i for i in ids if i not in special]
        texts = tokenizer.decode_batch([[i] for i in ids])
        encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
        self.vocab = [i for i, t, e in zip(ids, texts, encoded) if t and e.ids == [i]]
        if not self.vocab:
            raise ValueError("the tokenizer has no token that encodes back to itself")

    def make(self, num_tokens: int, rng: random.Random) -> str:
        """A random text that encodes to exactly `num_tokens` tokens."""
        content = num_tokens - self.num_added
        if content < 0:
            raise ValueError(
                f"a prompt of {num_tokens} tokens is shorter than the {self.num_added} the "
                "tokenizer adds to every text"
            )
        if content == 0:
            return ""
        for _ in range(_DRAWS):
            ids = self._draw(content, rng)
            for _ in range(_ROUNDS):
                text = self.tokenizer.decode(ids)
                got = self.tokenizer.encode(text, add_special_tokens=False).ids
                if len(got) == content and self.special_ids.isdisjoint(got):
                    return text
                if len(got) > content:
                    ids = got[:content]
                else:
                    ids = got + self._draw(content - len(got), rng)
        raise ValueError(f"could not make a text of exactly {num_tokens} tokens")

    def make_after(self, prefix: str, num_tokens: int, rng: random.Random) -> str:
        """`prefix` followed by a random text, the whole `num_tokens` tokens long; the prefix
        keeps its own tokens (the seam never merges into it), so prompts made after one prefix
        share its tokens exactly."""
        prefix_ids = self.tokenizer.encode(prefix).ids
        more = num_tokens - len(prefix_ids)
        if more < 1:
            raise ValueError(
                f"a prompt of {num_tokens} tokens leaves no room after a prefix of "
                f"{len(prefix_ids)}"
            )
        for _ in range(_DRAWS * _ROUNDS):
            text = prefix + self.tokenizer.decode(self._draw(more, rng))
            got = self.tokenizer.encode(text).ids
            if len(got) == num_tokens and got[: len(prefix_ids)] == prefix_ids:
                return text
        raise ValueError(f"could not make a text of exactly {num_tokens} tokens after the prefix")

    def _draw(self, count: int, rng: random.Random) -> list[int]:
        return [rng.choice(self.vocab) for _ in range(count)]
