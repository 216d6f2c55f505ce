"""A GGUF file's tokenizer, built once and read back from the cache, tokenizes as the one
transformers builds from the file; a directory's tokenizer, loaded by the class AutoTokenizer
chose for it before, is AutoTokenizer's, and loads without importing torch."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

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


def _same_tokenizer(tok: Tokenizer, reference) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    assert type(tok.hf) is type(reference)
    assert tok.vocab_size == len(reference)
    assert tok.eos_token_ids == Tokenizer(reference).eos_token_ids
    assert tok.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    for text in TEXTS:
        assert tok.encode(text) == reference.encode(text), text


def test_a_directory_loads_by_the_class_auto_tokenizer_chose(tmp_path, monkeypatch, model_dir):
    cache = tmp_path / "cache"
    monkeypatch.setenv("QUILL_CACHE", str(cache))
    directory = tmp_path / "model"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(model_dir / name, directory / name)
    reference = AutoTokenizer.from_pretrained(str(directory))
    _same_tokenizer(Tokenizer.load(directory), reference)  # resolved by AutoTokenizer
    (record,) = (cache / "tokenizers" / "classes").iterdir()
    assert json.loads(record.read_text()) == [type(reference).__module__, type(reference).__name__]
    _same_tokenizer(Tokenizer.load(directory), reference)  # by the recorded class

    # A fresh process (the server's API process) loads it without torch.
    probe = (
        "import sys; from pathlib import Path; from quill.frontend.tokenizer import Tokenizer;"
        f"t = Tokenizer.load(Path({str(directory)!r}));"
        "print(t.encode('Hi'), 'torch' in sys.modules)"
    )
    env = {**os.environ, "QUILL_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [*str(reference.encode("Hi")).split(), "False"]

    # Its files changed: AutoTokenizer chooses again (a second record).
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    again = Tokenizer.load(directory)
    assert again.hf.model_max_length == 77
    assert len(list((cache / "tokenizers" / "classes").iterdir())) == 2

    # A record naming a class that is gone: AutoTokenizer again, not an error.
    record.write_text(json.dumps(["transformers.no_such_module", "Nothing"]))
    for other in (cache / "tokenizers" / "classes").iterdir():
        other.write_text(json.dumps(["transformers", "NoSuchTokenizer"]))
    _same_tokenizer(Tokenizer.load(directory), AutoTokenizer.from_pretrained(str(directory)))
