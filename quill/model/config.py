"""The model's shape, read from a Hugging Face config.json (or built from GGUF metadata)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from quill.contract.errors import ModelLoadError
from quill.contract.kv_groups import KVGroups


@dataclass(frozen=True)
class Architecture:
    """What one Hugging Face architecture adds to the Llama block (RMSNorm, RoPE, GQA
    attention, SwiGLU MLP); `family` names its model file (quill/model/registry.py)."""

    family: str = "llama"
    qkv_bias: bool = False  # the q, k and v projections carry a bias
    qk_norm: bool = False  # q and k are RMS-normalised per head before RoPE
    # Whether the config's sliding_window applies only when use_sliding_window says so.
    window_opt_in: bool = False


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(),
    "MistralForCausalLM": Architecture(),
    "Qwen2ForCausalLM": Architecture(qkv_bias=True, window_opt_in=True),
    "Qwen3ForCausalLM": Architecture(qk_norm=True, window_opt_in=True),
    "Qwen3MoeForCausalLM": Architecture("qwen3_moe", qk_norm=True, window_opt_in=True),
    "Phi3ForCausalLM": Architecture(),  # q/k/v and gate/up fused in the checkpoint
    "Gemma3ForCausalLM": Architecture("gemma3", qk_norm=True),
    # Gemma 3's layers without the head: EmbeddingGemma (with use_bidirectional_attention).
    "Gemma3TextModel": Architecture("gemma3", qk_norm=True),
    # Encoders (embedding models: all-MiniLM-L6-v2 and the other sentence-transformers BERTs).
    "BertModel": Architecture("bert", qkv_bias=True),
    # Cross-encoders (rerankers such as ms-marco-MiniLM-L-6-v2): BERT and a classifier head.
    "BertForSequenceClassification": Architecture("bert", qkv_bias=True),
}


@dataclass(frozen=True)
class MoEConfig:
    """A sparse MLP's shape (Qwen3-MoE): `num_experts` experts of width `intermediate_size`,
    `top_k` of them per token, their router weights renormalised to sum to 1 when
    `normalise`; the layers in `layers` are sparse, the others dense."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalise: bool
    layers: tuple[int, ...]


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
    qk_norm: bool = False
    moe: MoEConfig | None = None
    family: str = "llama"
    sliding_window: int | None = None  # each query sees only its last this many keys
    # Gemma 3: each layer's window (0: global attention), the sliding layers' RoPE base, the
    # attention scale's 1 / sqrt(query_pre_attn_scalar).
    layer_windows: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    query_pre_attn_scalar: float | None = None
    # Encoders (BERT; Gemma 3 with use_bidirectional_attention, as EmbeddingGemma): every
    # token sees every other (a sliding layer: those within half its window either side; no
    # KV cache: a prompt is one pass), and BERT's token types (segment A / B) embedded beside
    # the positions.
    causal: bool = True
    type_vocab_size: int = 0
    num_labels: int = 0  # a classification head's outputs (a cross-encoder's); 0: none

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        archs = d.get("architectures") or []
        arch = next((a for a in archs if a in ARCHITECTURES), None)
        if arch is None:
            raise ModelLoadError(
                f"unsupported architecture {archs or d.get('model_type')!r}; quill supports "
                f"{', '.join(sorted(ARCHITECTURES))}"
            )
        traits = ARCHITECTURES[arch]
        _refuse_what_is_not_modelled(arch, d)
        if d.get("use_bidirectional_attention") and traits.family != "gemma3":
            raise ModelLoadError(f"{arch}: use_bidirectional_attention is not supported")
        if traits.family == "gemma3":
            d = _gemma3(d)
        if traits.family == "bert":
            d = _bert(d)
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
            attention_bias=traits.qkv_bias or bool(d.get("attention_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            qk_norm=traits.qk_norm,
            moe=_moe(d) if traits.family == "qwen3_moe" else None,
            family=traits.family,
            sliding_window=_window(d, traits),
            layer_windows=d.get("_layer_windows"),
            local_rope_theta=d.get("_local_rope_theta"),
            query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
            causal=traits.family != "bert" and not d.get("use_bidirectional_attention"),
            type_vocab_size=d.get("type_vocab_size", 0),
            num_labels=_num_labels(arch, d),
        )

    @property
    def kv_bytes_per_token(self) -> int:
        """KV cache bytes per token per element byte (multiply by the dtype's size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @property
    def kv_groups(self) -> KVGroups:
        """How the layers' KV caches share the block pool (their windows decide)."""
        return KVGroups.of(self.layer_windows or [self.sliding_window or 0] * self.num_layers)


def _refuse_what_is_not_modelled(arch: str, d: dict) -> None:
    """A config field that would change the model's outputs and that quill does not model is
    refused by name, never ignored."""
    if float(d.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ModelLoadError(
            f"{arch}: partial_rotary_factor {d['partial_rotary_factor']} (rotary embeddings "
            "on part of each head) is not supported"
        )
    scaling = d.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in (None, "default", "linear", "llama3", "freq_factors"):
        raise ModelLoadError(f"{arch}: rope_scaling of type {kind!r} is not supported")


def _num_labels(arch: str, d: dict) -> int:
    if not arch.endswith("ForSequenceClassification"):
        return 0
    return len(d.get("id2label") or {}) or int(d.get("num_labels", 2))


def _bert(d: dict) -> dict:
    """BERT's fields read into the config's (its LayerNorm epsilon where RMSNorm's goes; no
    output head), and what quill refuses (relative positions, other activations)."""
    kind = d.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelLoadError(f"BertModel: position_embedding_type {kind!r} is not supported")
    if d.get("hidden_act", "gelu") != "gelu":
        raise ModelLoadError(f"BertModel: hidden_act {d['hidden_act']!r} is not supported")
    return {**d, "rms_norm_eps": d.get("layer_norm_eps", 1e-12), "tie_word_embeddings": True,
            "eos_token_id": None}  # fmt: skip


def _gemma3(d: dict) -> dict:
    """Gemma 3's fields read into the config's: per-layer windows from layer_types (or its
    every-sixth-layer-global pattern), the two RoPE bases (transformers 5 nests them by layer
    type), and what quill refuses (soft-capped logits)."""
    for cap in ("final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(cap) is not None:
            raise ModelLoadError(f"Gemma 3: {cap} is not supported")
    num_layers = d["num_hidden_layers"]
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6
    types = d.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(num_layers)
    ]
    window = int(d["sliding_window"])
    ropes = d.get("rope_parameters") or {}
    full = ropes.get("full_attention") or {}
    local = ropes.get("sliding_attention") or {}
    out = {k: v for k, v in d.items() if k not in ("rope_parameters", "sliding_window")}
    out["rope_theta"] = full.get("rope_theta") or d.get("rope_theta") or 1_000_000.0
    if full.get("rope_type", "default") != "default":
        out["rope_scaling"] = full
    out["_layer_windows"] = tuple(window if t == "sliding_attention" else 0 for t in types)
    out["_local_rope_theta"] = local.get("rope_theta") or d.get("rope_local_base_freq", 10000.0)
    return out


def _window(d: dict, traits: Architecture) -> int | None:
    """The sliding window every layer attends over, where the config sets one; None: full
    attention. Qwen's opt-in window covers only the layers past max_window_layers, which one
    model-wide window does not model: refused."""
    window = d.get("sliding_window")
    if traits.window_opt_in:
        if not d.get("use_sliding_window", False):
            return None
        raise ModelLoadError(
            "use_sliding_window (a window on some layers only) is not supported; "
            "use_sliding_window false serves the model with full attention"
        )
    return int(window) if window else None


def _moe(d: dict) -> MoEConfig:
    num_layers = d["num_hidden_layers"]
    step = d.get("decoder_sparse_step", 1) or 1
    dense = set(d.get("mlp_only_layers") or [])
    layers = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
    return MoEConfig(
        num_experts=d.get("num_experts") or d["num_local_experts"],  # transformers 5's name
        top_k=d["num_experts_per_tok"],
        intermediate_size=d["moe_intermediate_size"],
        normalise=bool(d.get("norm_topk_prob", False)),  # transformers' default
        layers=layers,
    )


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
