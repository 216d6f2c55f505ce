"""What a model costs per token: parameters, bytes read per pass, FLOPs, and KV cache bytes.

The cost model only needs a model's shape, never its weights, so this reads a config.json, a
GGUF header or a named preset without torch, and counts everything exactly so the figures can
be checked by hand.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from quill.contract.kv_format import ELEMENT_BYTES, parse_kv_cache_dtype
from quill.contract.kv_groups import KVGroups
from quill.cost.batch import BatchShape, logits_rows
from quill.cost.hardware import canonical_dtype
from quill.model.config import ModelConfig, tensor_parallel_problems

_DTYPE_BY_BYTES = {4: "float32", 2: "bfloat16", 1: "int8"}
_BYTES_BY_DTYPE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1}


def bytes_per_element(dtype: str) -> int:
    """Bytes of one weight or KV element stored in `dtype` (2 for names it does not know)."""
    return _BYTES_BY_DTYPE.get(canonical_dtype(str(dtype)), 2)


def kv_bytes_per_element(kv_cache_dtype: str, dtype: str = "auto") -> float:
    """Mean bytes of a KV element for a `--kv-cache-dtype` (int8 with its scales: 1 + 2/32;
    K,V apart: the mean of the two): `auto` is the `--dtype` asked for by name, else 16-bit
    whatever the weights, as the engine's (quill.model.loader.resolve_kv_cache_dtype)."""
    auto = 2 if dtype == "auto" else bytes_per_element(dtype)
    sides = parse_kv_cache_dtype(kv_cache_dtype)
    return sum(auto if s == "auto" else ELEMENT_BYTES[s] for s in sides) / 2


@dataclass
class ModelSpec:
    """A model's size and, unless abstract, its architecture (Llama-style decoder blocks).

    An abstract model (`num_layers is None`) is only weights: 2 FLOPs per parameter per token,
    every weight read once per pass, no attention, no KV cache, no activations.
    """

    name: str
    num_params: int
    bytes_per_param: float
    num_layers: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    num_kv_heads: int | None = None
    head_dim: int | None = None
    intermediate_size: int | None = None
    vocab_size: int | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    kv_bytes_per_element: float | None = None
    dtype: str | None = None
    # A sparse MLP (Qwen3-MoE): in `num_sparse_layers` layers the MLP is `num_experts`
    # experts of width `expert_intermediate_size`, `experts_per_token` run for each token.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    num_sparse_layers: int = 0
    sliding_window: int | None = None  # every layer's queries see at most this many keys
    # Gemma 3's: each layer's window (0: global), when windowed layers sit between global ones.
    layer_windows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_params, int) or self.num_params <= 0:
            raise ValueError(f"num_params must be a positive integer, got {self.num_params!r}")
        bpp = self.bytes_per_param
        if not isinstance(bpp, int | float) or not math.isfinite(bpp) or bpp <= 0:
            raise ValueError(f"bytes_per_param must be positive, got {bpp!r}")
        if self.kv_bytes_per_element is None:
            self.kv_bytes_per_element = bpp
        elif not self.kv_bytes_per_element > 0:
            raise ValueError(
                f"kv_bytes_per_element must be positive, got {self.kv_bytes_per_element!r}"
            )
        self.dtype = canonical_dtype(self.dtype or _DTYPE_BY_BYTES.get(bpp, "bfloat16"))
        shape = (
            self.num_layers,
            self.hidden_size,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.intermediate_size,
            self.vocab_size,
        )
        if any(v is not None for v in shape):
            if any(not isinstance(v, int) or v <= 0 for v in shape):
                raise ValueError(f"model {self.name!r}: every shape field must be a positive int")
            if self.num_heads % self.num_kv_heads:
                raise ValueError(
                    f"num_heads ({self.num_heads}) must be a multiple of "
                    f"num_kv_heads ({self.num_kv_heads})"
                )

    # -- constructors --------------------------------------------------------------------
    @classmethod
    def abstract(cls, num_params: float, bytes_per_param: float, name: str = "") -> ModelSpec:
        if not num_params > 0:
            raise ValueError(f"num_params must be positive, got {num_params!r}")
        count = round(num_params)
        return cls(name or f"{count:.4g} params", count, bytes_per_param)

    @classmethod
    def from_hf_config(
        cls, config: dict, bytes_per_param: float = 2, name: str | None = None
    ) -> ModelSpec:
        """From a Hugging Face config.json dict; the parameter count is derived from the shape."""
        try:
            c = ModelConfig.from_hf_dict(config)
        except KeyError as e:
            raise ValueError(f"model config lacks {e.args[0]!r}") from None
        h, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        layer = h * q + 2 * h * kv + q * h + 2 * h
        if c.attention_bias:
            layer += q + 2 * kv
        if c.qk_norm:
            layer += 2 * c.head_dim
        sparse = len(c.moe.layers) if c.moe else 0
        mlps = (c.num_layers - sparse) * 3 * h * c.intermediate_size
        if c.moe:  # every expert, and the router
            mlps += sparse * c.moe.num_experts * (3 * h * c.moe.intermediate_size + h)
        embed = c.vocab_size * h
        num_params = c.num_layers * layer + mlps + embed + (0 if c.tie_word_embeddings else embed)
        num_params += h
        experts = {}
        if c.moe:
            experts = dict(num_experts=c.moe.num_experts, experts_per_token=c.moe.top_k,
                           expert_intermediate_size=c.moe.intermediate_size,
                           num_sparse_layers=sparse)  # fmt: skip
        return cls(
            name=name or config.get("_name_or_path") or c.architecture,
            num_params=num_params,
            bytes_per_param=bytes_per_param,
            num_layers=c.num_layers,
            hidden_size=h,
            num_heads=c.num_heads,
            num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim,
            intermediate_size=c.intermediate_size,
            vocab_size=c.vocab_size,
            tie_word_embeddings=c.tie_word_embeddings,
            attention_bias=c.attention_bias,
            sliding_window=c.sliding_window,
            layer_windows=c.layer_windows,
            **experts,
        )

    @classmethod
    def from_path(cls, path: str | Path, bytes_per_param: float | None = None) -> ModelSpec:
        """An HF model directory, its config.json, or a .gguf file.

        Without `bytes_per_param`, an HF config's torch_dtype decides (default 2). A GGUF is
        priced at what a pass reads of it as quill serves it: its K-quant tensors as the file
        stores them (their own bytes, mixed types included), the others at 2 bytes (bf16).
        """
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(f"no model config at {str(path)!r}")
        if path.suffix == ".gguf":
            from quill.model.gguf_config import gguf_hf_config, open_gguf

            reader = open_gguf(path)
            config = gguf_hf_config(reader)
            spec = cls.from_hf_config(config, 2, name=path.stem)
            spec.bytes_per_param = bytes_per_param or gguf_bytes_per_param(reader, spec)
            return spec
        try:
            config = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{str(path)!r} is not valid JSON: {e}") from e
        if bytes_per_param is None:
            bytes_per_param = bytes_per_element(config.get("torch_dtype"))
        return cls.from_hf_config(config, bytes_per_param, name=path.parent.name)

    @classmethod
    def preset(cls, name: str, bytes_per_param: float | None = None) -> ModelSpec:
        key = {k.lower(): k for k in PRESETS}.get(str(name).strip().lower())
        key = key or _PRESET_ALIASES.get(str(name).strip().lower())
        if key is None:
            raise ValueError(f"unknown model preset {name!r}; presets: {', '.join(PRESETS)}")
        return cls.from_hf_config(PRESETS[key], bytes_per_param or 2, name=key)

    @classmethod
    def resolve(cls, name_or_path: str | Path, bytes_per_param: float | None = None) -> ModelSpec:
        """A preset name (any case), an HF directory, a config.json or a .gguf."""
        text = str(name_or_path)
        lower = text.strip().lower()
        if lower in {k.lower() for k in PRESETS} or lower in _PRESET_ALIASES:
            return cls.preset(text, bytes_per_param)
        if Path(text).exists():
            return cls.from_path(text, bytes_per_param)
        raise ValueError(
            f"unknown model {text!r}: not a preset ({', '.join(PRESETS)}) nor an existing path"
        )

    # -- derived quantities --------------------------------------------------------------
    @property
    def is_abstract(self) -> bool:
        return self.num_layers is None

    @property
    def linear_params(self) -> int:
        """Matrix weights of all decoder layers (q, k, v, o, gate, up, down): 2 FLOPs each per
        token. Biases and norms cost one op per element and are left out of the FLOPs."""
        if self.is_abstract:
            return self.num_params
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        dense = self.num_layers - self.num_sparse_layers
        sparse = self.experts_per_token * 3 * h * self.expert_intermediate_size
        sparse += h * self.num_experts  # the router
        return (
            self.num_layers * (2 * h * q + 2 * h * kv)
            + dense * 3 * h * self.intermediate_size
            + self.num_sparse_layers * sparse
        )

    @property
    def params_read_per_pass(self) -> int:
        """Every parameter but the untied input embedding, of which a pass reads only its rows.
        Tied, the table is the lm_head and is read whole."""
        if self.is_abstract or self.tie_word_embeddings:
            return self.num_params
        return self.num_params - self.vocab_size * self.hidden_size

    @property
    def weight_bytes(self) -> float:
        """Bytes of weights one pass reads, however many tokens share it."""
        return self.params_read_per_pass * self.bytes_per_param

    def shape_of_seqs(self, seqs) -> BatchShape:
        """A step's shape under this model's attention: (start, num_tokens, samples,
        is_decode) per sequence. With windowed layers between global ones, the pairs and KV
        reads are the layers' mean (a windowed layer reads only its window)."""
        seqs = list(seqs)
        if not self.layer_windows:
            return BatchShape.from_seqs(seqs, self.sliding_window)
        full = BatchShape.from_seqs(seqs)
        window = max(self.layer_windows)
        if not window:
            return full
        windowed = BatchShape.from_seqs(seqs, window)
        share = sum(1 for w in self.layer_windows if w) / len(self.layer_windows)

        def mean(a: int, b: int) -> int:
            return round((1 - share) * a + share * b)

        return dataclasses.replace(
            full,
            attention_pairs=mean(full.attention_pairs, windowed.attention_pairs),
            kv_tokens_read=mean(full.kv_tokens_read, windowed.kv_tokens_read),
        )

    def shape_of(self, plan) -> BatchShape:
        """`shape_of_seqs` of an engine plan (BatchShape.from_plan's fast loop without one)."""
        if not self.sliding_window and not self.layer_windows:
            return BatchShape.from_plan(plan)
        return self.shape_of_seqs(
            (s.start, s.num_tokens, logits_rows(s), s.is_decode) for s in plan.seqs
        )

    def weight_bytes_for(self, num_tokens: int) -> float:
        """Bytes of weights a pass of `num_tokens` tokens reads: all of them, but for a sparse
        MLP only the experts its tokens chose: of E experts, k a token, chosen uniformly,
        E * (1 - (1 - k/E)^n) are expected to be touched by n tokens."""
        if not self.num_experts:
            return self.weight_bytes
        e, k = self.num_experts, self.experts_per_token
        untouched = e * (1 - k / e) ** num_tokens
        expert = 3 * self.hidden_size * self.expert_intermediate_size * self.bytes_per_param
        return self.weight_bytes - self.num_sparse_layers * untouched * expert

    @property
    def stored_bytes(self) -> float:
        """Bytes the weights occupy in memory (the input embedding included)."""
        return self.num_params * self.bytes_per_param

    @property
    def activation_bytes_per_element(self) -> int:
        # Activations are computed in float32 or a 16-bit float whatever the weights' storage.
        return 4 if self.dtype == "float32" else 2

    def linear_flops(self, num_tokens: int, num_sampled: int = 0) -> int:
        """Matmul FLOPs: every layer's weights for each token, and the lm_head only for the
        rows mapped to logits (the engine maps only those: rows that sample, prompt rows a
        request scores)."""
        if self.is_abstract:
            return 2 * self.num_params * num_tokens
        return 2 * self.linear_params * num_tokens + 2 * self.hidden_size * self.vocab_size * (
            num_sampled
        )

    def attention_flops(self, attention_pairs: int) -> int:
        """QK^T and PV: 2 FLOPs each per head dimension for each (query, key) pair, per head."""
        if self.is_abstract:
            return 0
        return 4 * self.num_layers * self.num_heads * self.head_dim * attention_pairs

    @property
    def kv_groups(self) -> KVGroups:
        """How its layers share the KV pool (quill/contract/kv_groups.py): windowed layers
        beside global ones make several groups."""
        if self.is_abstract:
            return KVGroups.uniform(1)
        windows = self.layer_windows or [self.sliding_window or 0] * self.num_layers
        return KVGroups.of(windows)

    @property
    def kv_bytes_per_token(self) -> float:
        """K and V of one token in every layer."""
        if self.is_abstract:
            return 0
        elements = 2 * self.num_layers * self.num_kv_heads * self.head_dim
        return elements * self.kv_bytes_per_element

    def activation_elements_per_token(self, tp: int = 1) -> tuple[float, int]:
        """(per token, per sampled token) activation elements read and written, per device.

        Each kernel of an unfused layer reads its inputs and writes its outputs once:
        2 norms (2h each), qkv projection (h + q + 2kv), attention (reads q, writes q; the KV
        cache is counted apart), o projection (q + h), 2 residual adds (3h each), gate/up
        (h + 2I), SiLU-and-multiply (3I), down (I + h). Per layer: 14h + 4q + 2kv + 6I, where
        the q, kv and I terms split over tensor-parallel devices and the h terms do not. Plus
        4h per token outside the layers (embedding row in and out, final norm) and h + vocab
        per sampled token (the lm_head reads the hidden row and writes its logits).
        """
        if self.is_abstract:
            return 0, 0
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        per_layer = 14 * h + (4 * q + 2 * kv + 6 * self.intermediate_size) / tp
        return self.num_layers * per_layer + 4 * h, h + self.vocab_size // tp

    def activation_bytes(self, num_tokens: int, num_sampled: int = 0) -> float:
        """Estimated bytes of activations moved by one pass (see activation_elements_per_token)."""
        per_token, per_sampled = self.activation_elements_per_token()
        return self.activation_bytes_per_element * (
            per_token * num_tokens + per_sampled * num_sampled
        )

    def check_tensor_parallel(self, tp: int) -> None:
        """Raise unless the model splits evenly over `tp` devices (Megatron-style heads)."""
        if not isinstance(tp, int) or tp < 1:
            raise ValueError(f"tp must be an integer >= 1, got {tp!r}")
        if tp == 1:
            return
        if self.is_abstract:
            raise ValueError(
                "tensor parallelism needs the model's architecture (hidden size, heads) to price "
                "its all-reduces; give a model, not just a parameter count"
            )
        inter = self.intermediate_size or 0
        problems = tensor_parallel_problems(self.num_heads, self.num_kv_heads, inter, tp)
        if problems:
            raise ValueError(f"tp={tp} cannot split the model: {'; '.join(problems)}")


# Hugging Face config.json figures of the presets (the fields the cost model reads).
PRESETS: dict[str, dict] = {
    # meta-llama/Meta-Llama-3-8B
    "Llama-3-8B": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    # meta-llama/Meta-Llama-3-70B
    "Llama-3-70B": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": False,
    },
    # mistralai/Mistral-7B-v0.1 (without its 4096-token sliding window: give "sliding_window")
    "Mistral-7B": {
        "architectures": ["MistralForCausalLM"],
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
        "max_position_embeddings": 32768,
        "tie_word_embeddings": False,
    },
    # Qwen/Qwen2-7B (q, k and v projections carry a bias)
    "Qwen2-7B": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "max_position_embeddings": 131072,
        "tie_word_embeddings": False,
    },
    # HuggingFaceTB/SmolLM2-135M (quill's default model is its Instruct variant)
    "SmolLM2-135M": {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_hidden_layers": 30,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    },
}

_PRESET_ALIASES = {
    "mistral-7b-v0.1": "Mistral-7B",
    "smollm2-135m-instruct": "SmolLM2-135M",
    "meta-llama-3-8b": "Llama-3-8B",
    "meta-llama-3-70b": "Llama-3-70B",
}


def gguf_bytes_per_param(reader, spec: ModelSpec, float_bytes: float = 2) -> float:
    """The average bytes a read weight takes in a GGUF file as quill serves it: the 2-D
    tensors of a type quill reads in place (the K-quants, IQ4_XS, F32 / F16 / BF16) at their
    stored bytes; those in blocks of 32 as the product made from them reads them (Q8_0, Q5_0,
    IQ4_NL as int8: 34 bytes a block; Q4_x 20; Q5_1 36); the rest at `float_bytes`; the input
    embedding left out unless it is also the head (as params_read_per_pass)."""
    from quill.ops.gguf_types import FLOAT_TYPES, MADE_BLOCK_BYTES, NAMES

    stored, total, read_bytes = {*NAMES.values(), *FLOAT_TYPES}, 0, 0.0
    for t in reader.tensors:
        if t.name == "token_embd.weight" and not spec.tie_word_embeddings:
            continue
        numel = 1
        for n in t.shape:
            numel *= n
        total += numel
        kind = t.tensor_type.name if len(t.shape) == 2 else None
        if kind in stored:
            read_bytes += t.data.nbytes
        elif kind in MADE_BLOCK_BYTES:
            read_bytes += numel * MADE_BLOCK_BYTES[kind] / 32
        else:
            read_bytes += numel * float_bytes
    return read_bytes / total if total else float_bytes
