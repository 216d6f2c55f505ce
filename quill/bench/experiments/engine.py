"""The one engine the experiments measure, and what decides its size.

Predictions are only comparable with measurements if both describe the same engine, so it is
always float32 with unquantized weights (the cost model prices float weights), sized for the
steps and requests the chosen experiments declared (`Needs`) and no more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from quill.cost.model import ModelSpec
from quill.cost.sweep import Case

DTYPE = "float32"
QUANTIZATION = "none"
BLOCK_SIZE = 16


@dataclass
class Needs:
    """What an experiment asks of the shared engine: the sweep cases it runs, and any token
    budget, sequence count or KV tokens its own real requests need beyond them."""

    cases: list[Case] = field(default_factory=list)
    budget: int = 1
    seqs: int = 1
    kv_tokens: int = 0


def build_engine(needs: list[Needs], model_dir: Path, model: ModelSpec):
    """An LLMEngine (float32, unquantized) whose budget, sequence limit and KV pool hold every
    case and request the experiments declared, and no more."""
    from quill.config import EngineConfig
    from quill.engine.llm_engine import LLMEngine

    cases = [c for n in needs for c in n.cases]
    budget = max([n.budget for n in needs] + [c.step_tokens for c in cases] + [1])
    seqs = max([n.seqs for n in needs] + [c.decodes + c.chunks for c in cases] + [1])
    blocks = max(
        [-(-c.kv_tokens // BLOCK_SIZE) + c.decodes + c.chunks for c in cases]
        + [-(-n.kv_tokens // BLOCK_SIZE) + n.seqs for n in needs]
        + [1]
    )
    config = EngineConfig(
        model=str(model_dir),
        dtype=DTYPE,
        quantization=QUANTIZATION,
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=budget,
        max_num_seqs=seqs,
        kv_cache_memory=int((blocks + 4) * BLOCK_SIZE * model.kv_bytes_per_token),
    )
    return LLMEngine(config)
