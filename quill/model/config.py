"""The model's shape, read from a Hugging Face config.json (or built from GGUF metadata)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quill.contract.errors import ModelLoadError

# Architectures that share the Llama block: RMSNorm, RoPE, GQA attention, SwiGLU MLP.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": False,  # value: QKV projections carry a bias
    "MistralForCausalLM": False,
    "Qwen2ForCausalLM": True,
}


@dataclass
class ModelConfig:
    """Everything the forward pass needs to know about the model's shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    bos_token_id: int | None
    eos_token_ids: list[int]

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or d.get('model_type')!r}; quill supports "
                f"{sorted(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = d["num_attention_heads"]
        eos_ids = as_id_list(d.get("eos_token_id"))
        rope_scaling = d.get("rope_scaling") or None
        rope_theta = d.get("rope_theta")
        if rope_theta is None and isinstance(d.get("rope_parameters"), dict):
            rope_theta = d["rope_parameters"].get("rope_theta")
            if d["rope_parameters"].get("rope_type", "default") != "default":
                rope_scaling = d["rope_parameters"]
        return cls(
            architecture=arch,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=d.get("num_key_value_heads") or num_heads,
            head_dim=d.get("head_dim") or d["hidden_size"] // num_heads,
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=SUPPORTED_ARCHITECTURES[arch] or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token per element byte (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def tensor_parallel_problems(
    num_heads: int, num_kv_heads: int, intermediate_size: int, size: int
) -> list[str]:
    """Why `size` ranks cannot split a model of this shape (empty: they can). Query heads
    and the MLP's width must divide; KV heads must divide, or, when the ranks outnumber them,
    the ranks must be a multiple of them (each KV head is then kept by several ranks)."""
    problems = []
    if num_heads % size:
        problems.append(f"its {num_heads} query heads do not divide among {size} ranks")
    if size <= num_kv_heads and num_kv_heads % size:
        problems.append(f"its {num_kv_heads} KV heads do not divide among {size} ranks")
    if size > num_kv_heads and size % num_kv_heads:
        problems.append(
            f"{size} ranks are more than its {num_kv_heads} KV heads but not a multiple of them "
            "(to replicate each)"
        )
    if intermediate_size % size:
        problems.append(f"its MLP width {intermediate_size} does not divide among {size} ranks")
    return problems


def as_id_list(value) -> list[int]:
    """A config's token id field (absent, one id, or a list) as a list."""
    if value is None:
        return []
    return [value] if isinstance(value, int) else [int(v) for v in value]


def generation_config_eos_ids(source: Path) -> list[int]:
    """End ids in a model directory's generation_config.json (often a list; [] when absent)."""
    path = source / "generation_config.json" if source.is_dir() else None
    if path is None or not path.is_file():
        return []
    return as_id_list(json.loads(path.read_text()).get("eos_token_id"))
