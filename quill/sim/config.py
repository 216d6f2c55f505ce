"""One simulated replica's settings: the cost model that times its steps and the scheduler's
limits, with the KV pool sized the way `quill serve` would size it on that hardware.

Checked once here, so that an impossible setup (a model that does not fit, a pool too small for
any request) is one clear error before the simulation starts, not a failure deep inside it.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from quill.config import SpeculativeConfig
from quill.contract.kv_groups import peak_blocks
from quill.cost.hardware import HardwareSpec
from quill.cost.model import PRESETS, ModelSpec
from quill.cost.step import CostModel
from quill.model.config import ModelConfig
from quill.sim.speculation import SpecChances

# The share of device memory given to weights and KV cache (the cost model's default).
MEMORY_FRACTION = 0.9
DEFAULT_MAX_MODEL_LEN = 8192  # for models whose context length is unknown (abstract ones)


@dataclass
class SimConfig:
    """Everything a replica needs; `num_blocks` is the KV pool size in blocks (of the model's
    `layers_per_block` layers each, quill/contract/kv_groups.py)."""

    cost: CostModel
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    enable_prefix_caching: bool = True  # as `quill serve`: reuse cached full prompt blocks
    # A decode replica's KV fetches take their time from the same cores as its steps (a CPU
    # host whose link is its own copies, as two instances on one machine): while both run,
    # each goes at half speed. Otherwise the link is a device of its own (a NIC, NVLink).
    fetch_shares_cores: bool = False
    # Percentiles 0..100 of measured / predicted step time (the calibration's): each step's
    # price is multiplied by a draw (quill/sim/jitter.py); None: every step at its price.
    step_jitter: tuple[float, ...] | None = None
    # The same per kind of step ("decode", "prefill", "mixed"), where measured apart and asked
    # for (`quill simulate --step-jitter-by-kind`); a step of a kind not here draws from
    # step_jitter. Off by default: over two validation runs (docs/benchmarks.md) the draws
    # from all steps' ratios, with the memory, came closer on TTFT and E2E p99.
    step_jitter_by_kind: dict[str, tuple[float, ...]] | None = None
    # How long a stray lasts: (shared, seconds), the calibration's `step_time_memory`
    # (quill/cost/refit.py); None: each step's draw independent of the one before.
    step_memory: tuple[float, float] | None = None
    seed: int = 0  # of the jitter's draws (each replica its own stream)
    # The host's time between back-to-back steps: (base seconds, seconds per sequence of the
    # step), measured by a serving calibration (`calibrate --from-steps`); (0, 0) without.
    step_gap: tuple[float, float] = (0.0, 0.0)
    # What a client sees outside the engine before its first token: the request's way in
    # (HTTP, tokenizing, the engine's inbox) and the first token's way out (detokenizing, the
    # stream). Measured by a benchmark against a server (client TTFT - the server's own);
    # added to every TTFT and end-to-end latency. 0: the engine's view.
    front_latency_s: float = 0.0
    # Steady decode steps run many at once (quill/sim/fast_forward.py): the same results,
    # faster. Off: every step through the engine core.
    fast_forward: bool = True
    # Speculative decoding as `quill serve --speculative-config` sets it (None: off), its
    # drafts and their acceptance drawn with `spec_chances` (quill/sim/speculation.py).
    speculative: SpeculativeConfig | None = None
    spec_chances: SpecChances = SpecChances()

    @classmethod
    def create(
        cls,
        model: ModelSpec,
        hardware: HardwareSpec,
        tp: int = 1,
        *,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        block_size: int = 16,
        max_model_len: int | None = None,
        kv_cache_memory: int | None = None,
        context_len: int | None = None,
        enable_prefix_caching: bool = True,
        fetch_shares_cores: bool = False,
        step_jitter: bool = True,
        jitter_by_kind: bool = False,
        seed: int = 0,
    ) -> SimConfig:
        """Raises ValueError on anything impossible. `kv_cache_memory` is bytes per device;
        without it the pool is what is left of 90% of the memory after the weights. Like the
        engine, the pool holds at most max_num_seqs sequences of full context."""
        for name, value in (
            ("max_num_seqs", max_num_seqs),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("block_size", block_size),
            ("max_model_len", max_model_len),
            ("kv_cache_memory", kv_cache_memory),
        ):
            if value is not None and value < 1:
                raise ValueError(f"{name.replace('_', '-')} must be positive, got {value}")
        cost = CostModel(model, hardware, tp)
        context = context_len or DEFAULT_MAX_MODEL_LEN
        max_model_len = min(max_model_len or context, context)
        capacity = cost.kv_capacity_tokens(MEMORY_FRACTION)  # raises if the weights do not fit
        kv_per_token = model.kv_bytes_per_token / tp
        room = capacity * kv_per_token  # bytes per device (inf: nothing limits the pool)
        if kv_cache_memory is not None and kv_per_token > 0:
            stored = model.stored_bytes / tp
            if stored + kv_cache_memory > hardware.memory_capacity:
                raise ValueError(
                    f"--kv-cache-memory of {kv_cache_memory / 1e9:.4g} GB and weights of "
                    f"{stored / 1e9:.4g} GB per device exceed {hardware.name}'s "
                    f"{hardware.memory_capacity / 1e9:.4g} GB"
                )
            room = kv_cache_memory
        # A pool block holds `layers_per_block` of the layers (quill/contract/kv_groups.py).
        groups = model.kv_groups
        per_block = kv_per_token * block_size / groups.num_groups
        chunk = min(max_num_batched_tokens or 8192, max_model_len)
        blocks_per_seq = peak_blocks(groups.group_windows, max_model_len, chunk, block_size)
        cap = blocks_per_seq * max_num_seqs
        num_blocks = cap if math.isinf(capacity) else min(int(room // per_block), cap)
        if num_blocks < 1:
            raise ValueError(
                f"the KV pool holds no block of {block_size} tokens "
                f"({kv_per_token * block_size:.4g} bytes per device)"
            )
        return cls(
            cost=cost,
            num_blocks=num_blocks,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens or 8192,
            block_size=block_size,
            enable_prefix_caching=enable_prefix_caching,
            fetch_shares_cores=fetch_shares_cores,
            step_jitter=step_ratios(hardware) if step_jitter else None,
            step_jitter_by_kind=step_ratios_by_kind(hardware)
            if step_jitter and jitter_by_kind
            else None,
            step_memory=step_memory(hardware) if step_jitter else None,
            seed=seed,
            step_gap=step_gap(hardware),
        )

    @property
    def kv_tokens(self) -> int:
        """The pool's size in tokens of every layer's keys and values."""
        return self.num_blocks * self.block_size // self.cost.model.kv_groups.num_groups

    def check_request(self, prompt_tokens: int, output_tokens: int) -> str | None:
        """Why a request of these lengths can never be served here, or None."""
        if prompt_tokens + output_tokens > self.max_model_len:
            return (
                f"{prompt_tokens} prompt + {output_tokens} output tokens exceed the model's "
                f"context of {self.max_model_len} tokens"
            )
        windows = self.cost.model.kv_groups.group_windows
        chunk = min(self.max_num_batched_tokens, prompt_tokens + 1)
        if peak_blocks(windows, prompt_tokens + 1, chunk, self.block_size) > self.num_blocks:
            return (
                f"a prompt of {prompt_tokens} tokens can never fit in the KV cache "
                f"({self.kv_tokens} tokens)"
            )
        return None

    def to_dict(self) -> dict:
        return {
            "model": self.cost.model.name,
            "hardware": self.cost.hardware.name,
            "tp": self.cost.tp,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "block_size": self.block_size,
            "enable_prefix_caching": self.enable_prefix_caching,
            "max_model_len": self.max_model_len,
            "num_kv_blocks": self.num_blocks,
            "kv_cache_tokens": self.kv_tokens,
            "step_jitter": self.step_jitter is not None,
            "step_jitter_kinds": sorted(self.step_jitter_by_kind or ()),
            "step_memory": None if self.step_memory is None else list(self.step_memory),
            "step_gap_s": list(self.step_gap),
            "front_latency_s": self.front_latency_s,
            "speculative": None
            if self.speculative is None
            else {**asdict(self.speculative), **asdict(self.spec_chances)},
        }


def step_ratios(hardware: HardwareSpec) -> tuple[float, ...] | None:
    """The calibration's step-time ratio percentiles, if it measured them."""
    ratios = (hardware.calibration or {}).get("step_time_ratios")
    return tuple(ratios) if ratios and len(ratios) == 101 else None


def step_ratios_by_kind(hardware: HardwareSpec) -> dict[str, tuple[float, ...]] | None:
    """The calibration's step-time ratio percentiles per kind of step, if it measured them."""
    by_kind = (hardware.calibration or {}).get("step_time_ratios_by_kind") or {}
    out = {k: tuple(v) for k, v in by_kind.items() if v and len(v) == 101}
    return out or None


def step_memory(hardware: HardwareSpec) -> tuple[float, float] | None:
    """The calibration's step-time memory (shared, seconds), if it measured one."""
    memory = (hardware.calibration or {}).get("step_time_memory")
    return (float(memory["shared"]), float(memory["seconds"])) if memory else None


def step_gap(hardware: HardwareSpec) -> tuple[float, float]:
    gap = (hardware.calibration or {}).get("step_gap") or {}
    return (float(gap.get("base_s", 0.0)), float(gap.get("per_seq_s", 0.0)))


def model_context_len(name_or_path: str, spec: ModelSpec) -> int | None:
    """The model's context length as the engine reads it from the model's config (None for a
    model without one, such as an abstract spec)."""
    path = Path(str(name_or_path).strip())
    if not path.exists():
        config = PRESETS.get(spec.name)
    else:
        if path.is_dir():
            path = path / "config.json"
        try:
            if path.suffix == ".gguf":
                from quill.model.gguf_config import gguf_hf_config, open_gguf

                config = gguf_hf_config(open_gguf(path))
            else:
                config = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
    if not isinstance(config, dict):
        return None
    return ModelConfig.from_hf_dict(config).max_position_embeddings
