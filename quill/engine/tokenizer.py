"""The model's tokenizer: encoding, decoding and the chat template."""

from __future__ import annotations

from pathlib import Path

from quill.errors import ModelLoadError


class Tokenizer:
    """Wraps a transformers fast tokenizer; encode/decode go straight to its Rust backend."""

    def __init__(self, hf_tokenizer, eos_token_ids: list[int] | None = None) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        eos = list(eos_token_ids or [])
        if hf_tokenizer.eos_token_id is not None and hf_tokenizer.eos_token_id not in eos:
            eos.append(hf_tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def load(cls, source: Path, eos_token_ids: list[int] | None = None) -> Tokenizer:
        from transformers import AutoTokenizer

        try:
            if source.is_file():
                hf = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
            else:
                hf = AutoTokenizer.from_pretrained(str(source))
        except Exception as e:
            raise ModelLoadError(f"could not load a tokenizer from {str(source)!r}: {e}") from e
        return cls(hf, eos_token_ids)

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

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
