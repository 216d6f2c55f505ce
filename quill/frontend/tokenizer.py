"""The model's tokenizer: encoding, decoding and the chat template.

Two things are kept under `$QUILL_CACHE/tokenizers` because they cost every start:
- A GGUF file's tokenizer is built by transformers from the file's vocabulary, which for a large
  vocabulary is slow (Gemma 3's 262,144 tokens: about 12 s of a 27 s start, paid again by the
  server's front end): built once, named by the file's path, size and modification time.
- The class `AutoTokenizer` resolves a directory to. To choose it, AutoTokenizer reads the
  model's config, and importing it imports torch and transformers' model code: 1.8 s here,
  paid by the server's API process (which needs no torch) after the engine is up, and again
  by the engine. The class is recorded, named by the files AutoTokenizer reads and the
  transformers version, and later loads call it directly, as AutoTokenizer itself ends.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import logging
import os
import shutil
from pathlib import Path

from quill.config import cache_dir
from quill.contract.errors import ModelLoadError

log = logging.getLogger(__name__)

# Special tokens that end a text, a turn or a message in the chat formats in use.
END_OF_TEXT_NAMES = frozenset(
    {
        "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
        "<|end|>", "<end_of_turn>", "<|return|>", "<|call|>", "</s>", "<EOT>",
    }
)  # fmt: skip


class Tokenizer:
    """Wraps a transformers fast tokenizer; encode/decode go straight to its Rust backend."""

    def __init__(self, hf_tokenizer, eos_token_ids: list[int] | None = None) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        # A tokenizer.json may pad and truncate every text to a fixed length (BERT-family
        # embedding models ship one that does): a prompt is its own tokens, no more, no less;
        # quill checks lengths against the context itself.
        self.backend.no_padding()
        self.backend.no_truncation()
        self.vocab_size = len(hf_tokenizer)
        self.eos_token_ids = self._end_ids(list(eos_token_ids or []))

    def _end_ids(self, declared: list[int]) -> list[int]:
        """Every id that ends generation: what the model declares (config, generation_config,
        GGUF), the tokenizer's eos, and special tokens named as an end of text.

        The names catch what a model uses but does not declare: SmolLM2 declares only
        <|im_end|>, yet ends a document with <|endoftext|> (llama.cpp marks such tokens too).
        """
        ids = list(declared)
        if self.hf.eos_token_id is not None:
            ids.append(self.hf.eos_token_id)
        for token_id, token in self.hf.added_tokens_decoder.items():
            if token.special and token.content in END_OF_TEXT_NAMES:
                ids.append(token_id)
        return list(dict.fromkeys(ids))

    @classmethod
    def load(cls, source: Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        try:
            hf = _gguf_tokenizer(source) if source.is_file() else _from_directory(source)
        except Exception as e:
            raise ModelLoadError(f"could not load a tokenizer from {str(source)!r}: {e}") from e
        return cls(hf, eos_token_ids)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters of text one token can stand for (bounds tokens from below)."""
        return max(len(t) for t in self.backend.get_vocab(with_added_tokens=True))

    @functools.cached_property
    def added_tokens(self) -> dict[str, int]:
        """The tokens added to the vocabulary (special or not), by their text."""
        return {t.content: token_id for token_id, t in self.hf.added_tokens_decoder.items()}

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_pair(self, first: str, second: str) -> tuple[list[int], int]:
        """Two texts as one input, as a cross-encoder reads them ([CLS] a [SEP] b [SEP]), and
        where the second one's tokens (token type 1) begin."""
        encoding = self.backend.encode(first, second)
        types = encoding.type_ids
        return encoding.ids, types.index(1) if 1 in types else len(types)

    def token_offsets(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Where each of `text`'s tokens starts in it, in characters (a token added by the
        tokenizer, such as BOS, at 0)."""
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        return [start for start, _ in encoding.offsets]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kwargs
    ) -> str:
        if not self.hf.chat_template:
            raise ModelLoadError("this model's tokenizer has no chat template")
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )


def _gguf_tokenizer(path: Path):
    """The GGUF file's tokenizer, from the cache when it was built before."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    cached = cache_dir() / "tokenizers" / hashlib.sha256(key).hexdigest()[:16]
    if (cached / "tokenizer.json").is_file():
        return _from_directory(cached)
    log.info("building the tokenizer of %s (once: kept at %s)", path.name, cached)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    partial = cached.with_name(f"{cached.name}.{os.getpid()}.partial")
    hf.save_pretrained(str(partial))
    try:
        partial.rename(cached)
    except OSError:  # another process kept it first
        shutil.rmtree(partial, ignore_errors=True)
    return hf


# What AutoTokenizer reads to choose a directory's class.
_CLASS_INPUTS = ("tokenizer_config.json", "config.json", "tokenizer.json", "tokenizer.model")


def _from_directory(directory: Path):
    """transformers' tokenizer of a directory, of the class AutoTokenizer resolves it to."""
    import transformers

    parts = [str(directory.resolve()), transformers.__version__]
    for name in _CLASS_INPUTS:
        if (directory / name).is_file():
            stat = (directory / name).stat()
            parts.append(f"{name}:{stat.st_size}:{stat.st_mtime_ns}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
    record = cache_dir() / "tokenizers" / "classes" / f"{key}.json"
    try:
        module, name = json.loads(record.read_text())
        tokenizer_class = getattr(importlib.import_module(module), name)
    except (OSError, ValueError, ImportError, AttributeError):
        tokenizer_class = None
    if tokenizer_class is not None:
        return tokenizer_class.from_pretrained(str(directory))
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(directory))
    module = type(hf).__module__
    if module.startswith("transformers."):  # never a class from a model's own code
        partial = record.with_name(f"{key}.{os.getpid()}.partial")
        try:
            record.parent.mkdir(parents=True, exist_ok=True)
            partial.write_text(json.dumps([module, type(hf).__name__]))
            partial.rename(record)
        except OSError:
            pass  # a read-only cache: AutoTokenizer again next time
    return hf
