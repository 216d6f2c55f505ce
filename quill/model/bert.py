"""BERT, the encoder of the sentence-transformers embedding models (all-MiniLM-L6-v2 and kin):
learned absolute positions and token types added to the token embeddings, a LayerNorm, then
post-LayerNorm layers of bidirectional attention and a GELU MLP.

An encoder keeps no KV cache: each prompt is one pass in which every token sees every other
(the scheduler never cuts an encoder's prompt, quill/engine/scheduler.py), so the layers take
the flat batch with each sequence's length and attend within each sequence. The runner pools
`forward`'s rows as a decoder's normed ones (`norm` is the identity: BERT's last LayerNorm is
inside its last layer).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quill.model.config import ModelConfig
from quill.model.llama import Target


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

    def forward(self, x: torch.Tensor, batch: _Padded) -> torch.Tensor:
        n, h = x.shape
        q, k, v = batch.pad(self.qkv(x)).view(batch.size, batch.longest, 3, self.num_heads,
                                              self.head_dim).permute(2, 0, 3, 1, 4)  # fmt: skip
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.mask)
        a = batch.unpad(a.transpose(1, 2).reshape(batch.size * batch.longest, h))
        x = self.attn_norm(x + self.out(a))
        return self.out_norm(x + self.output(F.gelu(self.inter(x))))


class _Padded:
    """The flat batch laid out as [sequences, longest] for attention within each sequence,
    padded keys masked out."""

    def __init__(self, seq_lens: list[int], device: torch.device) -> None:
        self.size, self.longest = len(seq_lens), max(seq_lens)
        lens = torch.tensor(seq_lens, device=device)
        within = torch.arange(self.longest, device=device)
        real = within[None, :] < lens[:, None]  # [B, L]
        self.rows = real.reshape(-1).nonzero().squeeze(1)  # padded slot of each flat row
        self.mask = real[:, None, None, :]  # [B, 1, 1, L]: keys a query may see

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        out = x.new_zeros(self.size * self.longest, x.shape[1])
        out[self.rows] = x
        return out

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.rows]


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

    def init_rope(self, max_positions: int) -> None:
        """No rotary tables: positions are learned embeddings."""

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]
    ) -> torch.Tensor:
        """The last layer's states of every token (all of segment A, token type 0)."""
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        x = self.embed_norm(x + self.token_type_embeddings.weight[0])
        batch = _Padded(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, batch)
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
    return None  # the pooler (a classification head's input), unused by embeddings
