"""What every experiment shares: its settings, the model and this machine's calibrated cost
model, and one engine sized for the steps the chosen experiments will run.

Predictions are only comparable with measurements if both describe the same engine, so the
engine here is always float32 with unquantized weights (the cost model prices float weights),
and the hardware is this machine's own calibration, found on disk or measured now.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from quill.bench.experiments.calibration import load_or_calibrate
from quill.bench.experiments.engine import BLOCK_SIZE, DTYPE, Needs, build_engine
from quill.cost.hardware import HardwareSpec
from quill.cost.model import ModelSpec
from quill.cost.step import CostModel

# The KV pool the experiments assume a server would have: the engine's CPU default ceiling.
DEFAULT_KV_CACHE_MEMORY = 4 << 30
DEFAULT_MAX_NUM_SEQS = 256  # the engine's default


@dataclass
class Settings:
    """The knobs of one run of the experiments."""

    quick: bool = False
    price_per_hour: float = 0.10
    hardware: str | None = None  # a calibration file; default: this machine's saved one
    recalibrate: bool = False  # measure a quick calibration now even if one is saved
    kv_cache_memory: int = DEFAULT_KV_CACHE_MEMORY
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    interconnect_bandwidth: float = 1.25e9  # bytes/s between two machines: 10 Gbit Ethernet
    model: str | None = None
    seed: int = 0
    progress: bool = True


def machine_info() -> dict:
    """The CPU, the SIMD flags that matter for matrix products, threads and versions."""
    import torch

    from quill.cost.calibrate import cpu_info

    info = cpu_info()
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_tile")
    return {
        "cpu_model": info["cpu_model"],
        "simd_flags": [f for f in wanted if f in info["cpu_flags"]],
        "cores_available": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


class Context:
    """Settings, the cost model and (on demand) the engine, for the experiments of one run."""

    def __init__(
        self, settings: Settings, out_dir: Path, log: Callable[[str], None] | None = None
    ) -> None:
        from quill.model.default_model import default_model_dir

        self.settings = settings
        self.out_dir = out_dir  # the figures and raw numbers
        self.log = log or (lambda text: print(text, file=sys.stderr, flush=True))
        self.model_dir = Path(settings.model) if settings.model else default_model_dir()
        self.model = ModelSpec.from_path(self.model_dir, 4)
        self.model.dtype = DTYPE
        self._hardware: HardwareSpec | None = None
        self.calibration: dict = {}
        self._engine = None
        self._needs: list[Needs] = []

    # -- the cost model -------------------------------------------------------------------
    @property
    def hardware(self) -> HardwareSpec:
        if self._hardware is None:
            self._hardware, self.calibration = load_or_calibrate(self)
        return self._hardware

    @property
    def cost(self) -> CostModel:
        return CostModel(self.model, self.hardware)

    # -- the engine ------------------------------------------------------------------------
    def plan(self, needs: Iterable[Needs]) -> None:
        """Declare what the experiments of this run need, before the engine is first built."""
        self._needs = list(needs)

    @property
    def engine(self):
        if self._engine is None:
            self._engine = build_engine(self._needs, self.model_dir, self.model)
        return self._engine

    def release_engine(self) -> None:
        """Free the engine's weights and KV pool (before a server needs the memory)."""
        self._engine = None
        import gc

        gc.collect()

    def kv_pool_tokens(self) -> int:
        """Tokens of KV cache in the pool the experiments assume a server has."""
        per_block = BLOCK_SIZE * self.model.kv_bytes_per_token
        return int(self.settings.kv_cache_memory // per_block) * BLOCK_SIZE

    def max_batch(self, tokens_per_seq: int) -> int:
        """The most sequences of `tokens_per_seq` tokens that server's pool and its
        max_num_seqs let run at once."""
        blocks_per_seq = -(-tokens_per_seq // BLOCK_SIZE)
        fits = (self.kv_pool_tokens() // BLOCK_SIZE) // blocks_per_seq
        return int(min(self.settings.max_num_seqs, fits))
