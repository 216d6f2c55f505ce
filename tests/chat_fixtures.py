"""Tokenizers and chat templates of the families with native tool and reasoning formats.

No Qwen, Llama 3.1, Mistral or DeepSeek-R1 tokenizer installs from the package registries, so
each family is the default model's BPE tokenizer plus the family's marker tokens (special or
not, as in the family's own tokenizer), with a chat template written to the family's
published format (tests/fixtures/chat_templates/*.jinja). A random-weight model of a family's
shape gets the same files (`family_model`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TEMPLATES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = ("qwen2.5", "qwen3", "llama3.1", "mistral", "mistral_v11", "deepseek_r1")

# Marker tokens: whether each is special in its family's tokenizer (a special token's text
# never matches it in a grammar, and decoding drops it unless asked to keep it).
MARKERS = {
    "<tool_call>": False, "</tool_call>": False, "<tool_response>": False,
    "</tool_response>": False, "<think>": False, "</think>": False,
    "<|python_tag|>": True, "<|eot_id|>": True, "<|start_header_id|>": True,
    "<|end_header_id|>": True, "<|begin_of_text|>": True,
    "[TOOL_CALLS]": True, "[AVAILABLE_TOOLS]": True, "[/AVAILABLE_TOOLS]": True,
    "[TOOL_RESULTS]": True, "[/TOOL_RESULTS]": True, "[INST]": True, "[/INST]": True,
    "[ARGS]": True, "[SYSTEM_PROMPT]": True, "[/SYSTEM_PROMPT]": True,
    "<|fim_prefix|>": True, "<|fim_suffix|>": True, "<|fim_middle|>": True,
    "<|fim_pad|>": True, "<|repo_name|>": True, "<|file_sep|>": True,
    "<｜User｜>": True, "<｜Assistant｜>": True, "<｜end▁of▁sentence｜>": True,
}  # fmt: skip


def family_tokenizer(directory: Path, family: str) -> Path:
    """Write the family's tokenizer files (tokenizer.json, tokenizer_config.json with its
    chat template) into `directory`; returns it."""
    from tokenizers import AddedToken, Tokenizer

    from quill.model.default_model import default_model_dir

    source = default_model_dir()
    directory.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(source / "tokenizer.json"))
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, special in MARKERS.items() if not special])  # fmt: skip
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, special in MARKERS.items() if special])  # fmt: skip
    tok.save(str(directory / "tokenizer.json"))
    config = json.loads((source / "tokenizer_config.json").read_text())
    config["chat_template"] = (TEMPLATES / f"{family}.jinja").read_text()
    if family == "llama3.1":
        config |= {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def vocab_size(directory: Path) -> int:
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).get_vocab_size()


def family_model(directory: Path, family: str, kind: str = "qwen3", **shape) -> Path:
    """A random-weight model of `kind` (tiny, or of `shape`: config overrides) with the
    family's tokenizer."""
    from tests.conftest import random_checkpoint

    tokenizer_dir = family_tokenizer(directory / "tokenizer", family)
    random_checkpoint(directory, kind, sharded=False, vocab_size=vocab_size(tokenizer_dir),
                      **shape)  # fmt: skip
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, directory / name)
    return directory
