"""Each model family's forward pass and checkpoint names: one entry per family.

`quill.model.config.ARCHITECTURES` maps a Hugging Face architecture to its family (torch-free,
for the cost model); here the family gets its model class and its weight-name mapping. A new
family is one model file and one entry here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from quill.model import bert, gemma3, llama, qwen3_moe
from quill.model.config import ModelConfig


class Family(NamedTuple):
    model: type  # takes (config, max_positions)
    weight_target: Callable[[str, ModelConfig], llama.Target | None]
    encoder: type | None = None  # the model when the config is not causal (bidirectional)


FAMILIES: dict[str, Family] = {
    "llama": Family(llama.LlamaForCausalLM, llama.weight_target),
    "qwen3_moe": Family(qwen3_moe.Qwen3MoeForCausalLM, qwen3_moe.weight_target),
    "gemma3": Family(gemma3.Gemma3ForCausalLM, gemma3.weight_target, gemma3.Gemma3Encoder),
    "bert": Family(bert.BertModel, bert.weight_target),
}


def family(config: ModelConfig) -> Family:
    chosen = FAMILIES[config.family]
    if not config.causal and chosen.encoder is not None:
        return chosen._replace(model=chosen.encoder)
    return chosen
