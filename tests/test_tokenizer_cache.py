"""A GGUF file's tokenizer, built once and read back from the cache, tokenizes as the one
transformers builds from the file."""

from __future__ import annotations

from transformers import AutoTokenizer

from quill.frontend.tokenizer import Tokenizer
from quill.model.default_model import default_gguf_path

TEXTS = [
    "The capital of France is",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "<|im_start|>user\nHi<|im_end|> <|endoftext|>",
    "naïve café — 東京 🙂 1234567890",
    "",
]


def test_the_cached_tokenizer_is_the_files(tmp_path, monkeypatch):
    monkeypatch.setenv("QUILL_CACHE", str(tmp_path))
    path = default_gguf_path()
    reference = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    built = Tokenizer.load(path)
    cached_dirs = list((tmp_path / "tokenizers").iterdir())
    assert len(cached_dirs) == 1 and (cached_dirs[0] / "tokenizer.json").is_file()
    again = Tokenizer.load(path)  # from the cache
    assert again.hf.name_or_path == str(cached_dirs[0])
    messages = [{"role": "user", "content": "Hi"}]
    for tok in (built, again):
        assert tok.vocab_size == len(reference)
        assert tok.eos_token_ids == Tokenizer(reference).eos_token_ids
        assert tok.hf.chat_template == reference.chat_template
        assert tok.apply_chat_template(messages) == reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        for text in TEXTS:
            ids = reference.encode(text)
            assert tok.encode(text) == ids, text
            assert tok.decode(ids) == reference.decode(ids, skip_special_tokens=True)
