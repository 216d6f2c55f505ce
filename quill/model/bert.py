"""BERT, the encoder of the sentence-transformers embedding models (all-MiniLM-L6-v2 and kin)
and of the cross-encoders that rerank (BertForSequenceClassification: a tanh pooler and a
classifier on the first row): learned absolute positions and token types added to the token
embeddings, a LayerNorm, then post-LayerNorm layers of bidirectional attention and a GELU MLP.

An encoder keeps no KV cache: each prompt is one pass in which every token sees every other
(the scheduler never cuts an encoder's prompt, quill/engine/scheduler.py), so the layers take
the flat batch with each sequence's length and attend within each sequence
(quill/model/prompt_attention.py). The runner pools
`forward`'s rows as a decoder's normed ones (`norm` is the identity: BERT's last LayerNorm is
inside its last layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quill.model.config import ModelConfig
from quill.model.llama import Target
from quill.model.prompt_attention import PromptGroups


class BertLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = nn.Linear(h, 3 * h)  # the checkpoint's query, key and value, stacked
        self.out = nn.Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, config.rms_norm_eps)
        self.inter = nn.Linear(h, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, groups: PromptGroups) -> torch.Tensor:
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        a = groups.attend(q, k, v, self.head_dim**-0.5).view(x.shape[0], -1)
        x = self.attn_norm(x + self.out(a))
        return self.out_norm(x + self.output(F.gelu(self.inter(x))))


class BertModel(nn.Module):
    is_encoder = True

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(config.type_vocab_size, 1), h)
        self.embed_norm = nn.LayerNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_layers))
        self.norm = nn.Identity()
        if config.num_labels:  # a cross-encoder: the pooler (tanh) and the classifier
            self.pooler = nn.Linear(h, h)
            self.classifier = nn.Linear(h, config.num_labels)

    def classify(self, first_rows: torch.Tensor) -> torch.Tensor:
        """A cross-encoder's logits from each prompt's first ([CLS]) row."""
        return self.classifier(torch.tanh(self.pooler(first_rows)))

    def init_rope(self, max_positions: int) -> None:
        """No rotary tables: positions are learned embeddings."""

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int],
        token_types: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The last layer's states of every token (`token_types`: each token's segment, 0 for
        a single text, 1 for a pair's second)."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_types is None:
            x = self.embed_norm(x + self.token_type_embeddings.weight[0])
        else:
            x = self.embed_norm(x + self.token_type_embeddings(token_types))
        groups = PromptGroups(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, groups)
        return x


_LAYER_NAMES = {
    "attention.output.dense": "out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "inter",
    "output.dense": "output",
    "output.LayerNorm": "out_norm",
}
_QKV = ("attention.self.query", "attention.self.key", "attention.self.value")


def weight_target(name: str, config: ModelConfig) -> Target | None:
    """Our parameter for a BERT checkpoint's tensor (with or without the `bert.` prefix)."""
    name = name.removeprefix("bert.")
    h = config.hidden_size
    if name.startswith("embeddings."):
        part, _, kind = name.removeprefix("embeddings.").rpartition(".")
        if part == "position_ids" or kind == "position_ids":
            return None  # a buffer of 0, 1, 2, ...
        if part == "LayerNorm":
            return Target(f"embed_norm.{kind}", 0, h)
        rows = {"word_embeddings": config.vocab_size,
                "position_embeddings": config.max_position_embeddings,
                "token_type_embeddings": max(config.type_vocab_size, 1)}  # fmt: skip
        return Target(f"{part}.{kind}", 0, rows[part])
    if name.startswith("encoder.layer."):
        index, _, rest = name.removeprefix("encoder.layer.").partition(".")
        module, _, kind = rest.rpartition(".")
        if module in _QKV:
            return Target(f"layers.{index}.qkv.{kind}", _QKV.index(module) * h, h)
        rows = config.intermediate_size if module == "intermediate.dense" else h
        return Target(f"layers.{index}.{_LAYER_NAMES[module]}.{kind}", 0, rows)
    if config.num_labels and name.startswith("pooler.dense."):
        return Target(f"pooler.{name.rpartition('.')[2]}", 0, h)
    if config.num_labels and name.startswith("classifier."):
        return Target(f"classifier.{name.rpartition('.')[2]}", 0, config.num_labels)
    return None  # an embedding model's pooler, which embeddings do not use
