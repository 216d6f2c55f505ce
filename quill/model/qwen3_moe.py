"""Qwen3-MoE: the Llama family's layers (with Qwen3's q/k norms) where the MLP of each sparse
layer is a set of experts, `top_k` chosen per token by a router.

The tokens are grouped by expert (sorted once, a product per expert over its tokens), not
looped over: a step's cost is one pass over the experts its tokens chose. Each expert's two
projections are linear modules of their own, so that int8 / int4 swap them like any other.
Routing follows Hugging Face's: softmax over all experts in fp32, the top k, renormalised when
the config says so, rounded to the model's dtype before the experts' outputs are weighted and
summed.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from quill.model import llama
from quill.model.config import ModelConfig
from quill.model.linear import Linear
from quill.model.llama import DecoderLayer, LlamaForCausalLM, Target, split_layer_name
from quill.ops import fused


class SparseMoE(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        moe = config.moe
        hidden, inter = config.hidden_size, moe.intermediate_size
        self.top_k = moe.top_k
        self.normalise = moe.normalise
        self.router = nn.Parameter(torch.empty(moe.num_experts, hidden))
        experts = range(moe.num_experts)
        self.gate_up = nn.ModuleList(Linear(hidden, 2 * inter, bias=False) for _ in experts)
        self.down = nn.ModuleList(Linear(inter, hidden, bias=False) for _ in experts)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        probs = F.linear(h, self.router).softmax(-1, dtype=torch.float)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalise:
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(h.dtype).flatten()
        chosen = experts.flatten()  # token t's j-th choice at t * top_k + j
        order = chosen.argsort(stable=True)
        tokens = order // self.top_k
        counts = torch.bincount(chosen, minlength=self.router.shape[0]).tolist()
        grouped = h[tokens]
        outputs = []
        start = 0
        for expert, count in enumerate(counts):
            if count:
                x = grouped[start : start + count]
                gate, up = self.gate_up[expert](x).chunk(2, dim=-1)
                outputs.append(self.down[expert](fused.silu_mul(gate, up)))
                start += count
        y = torch.cat(outputs) * weights[order].unsqueeze(1)
        return torch.zeros_like(h).index_add_(0, tokens, y)


class MoEDecoderLayer(DecoderLayer):
    def __init__(self, config: ModelConfig, sparse: bool) -> None:
        self.sparse = sparse  # read by init_mlp, which the base __init__ calls
        super().__init__(config)

    def init_mlp(self, config: ModelConfig) -> None:
        if self.sparse:
            self.experts = SparseMoE(config)
        else:
            super().init_mlp(config)

    def mlp(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts(h) if self.sparse else super().mlp(h)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def make_layer(self, config: ModelConfig, index: int) -> nn.Module:
        return MoEDecoderLayer(config, sparse=index in config.moe.layers)


def weight_target(name: str, config: ModelConfig) -> Target | None:
    """Llama's names, plus a sparse layer's router (`mlp.gate`) and experts
    (`mlp.experts.E.gate_proj` / `up_proj` / `down_proj`), gate and up merged per expert."""
    if ".mlp.gate." not in name and ".mlp.experts." not in name:
        return llama.weight_target(name, config)
    idx, kind, suffix = split_layer_name(name, config)
    prefix = f"layers.{idx}.experts."
    if kind == "mlp.gate":
        return Target(prefix + "router", 0, config.moe.num_experts)
    _, _, expert, proj = kind.split(".")
    inter = config.moe.intermediate_size
    rows = {"gate_proj": ("gate_up", 0, inter), "up_proj": ("gate_up", inter, inter),
            "down_proj": ("down", 0, config.hidden_size)}[proj]  # fmt: skip
    assert suffix == "weight", name
    return Target(f"{prefix}{rows[0]}.{expert}.weight", rows[1], rows[2])
