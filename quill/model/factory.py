"""Builds what runs the steps: loads the model, sizes the KV pool, makes the torch executor.

The engine core takes an executor and a pool size and nothing else; everything that needs torch
to decide (device, dtype, free memory, the model's KV bytes per block) is settled here.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.config import EngineConfig
from quill.contract.errors import InvalidRequestError
from quill.contract.kv_groups import peak_blocks
from quill.frontend.tokenizer import Tokenizer
from quill.model.config import ModelConfig, generation_config_eos_ids
from quill.model.loader import (
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from quill.model.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class ModelExecutor:
    """A loaded model ready to execute plans, with what the engine must know about it."""

    runner: ModelRunner
    # Loaded here for the end-of-text ids (the front end loads its own); None on the
    # tensor-parallel ranks past 0.
    tokenizer: Tokenizer | None
    tokenizer_source: Path
    model_config: ModelConfig
    hf_config: dict
    model_path: Path
    device: torch.device
    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    max_model_len: int
    token_budget: int
    num_blocks: int


def build_model_executor(config: EngineConfig, tp=None) -> ModelExecutor:
    """The executor for `config`. With `tp` (quill.distributed.group.TensorParallel, handed
    in by that package, which starts the ranks) only that rank's slice of the model is kept."""
    device = resolve_device(config.device)
    if device.type == "cpu":
        _set_cpu_threads(tp.local_size if tp is not None else 1)
    dtype = resolve_dtype(config.dtype, device)
    model_path = model_path_of(config)
    loaded = load_model(model_path, config.load_format, dtype, device)
    blocks = loaded.blocks
    if tp is not None:
        tp.shard(loaded.model)
        blocks = {}  # each rank quantizes its own slices from the floats
    _quantize(loaded.model, config.quantization, device, blocks)
    tok_source = Path(config.tokenizer) if config.tokenizer else loaded.source
    tokenizer = None  # ranks past 0 neither sample nor hold back end tokens
    if tp is None or tp.is_driver:
        declared_ends = loaded.config.eos_token_ids + generation_config_eos_ids(loaded.source)
        tokenizer = Tokenizer.load(tok_source, declared_ends)
    ctx = loaded.config.max_position_embeddings
    max_model_len = min(config.max_model_len or ctx, ctx)
    budget = config.max_num_batched_tokens or (512 if device.type == "cpu" else 8192)
    kv_cache_dtype = resolve_kv_cache_dtype(
        config.kv_cache_dtype, dtype, device, dtype_asked=config.dtype != "auto"
    )
    runner = ModelRunner(
        loaded.model,
        device,
        dtype,
        config.block_size,
        config.seed,
        tokenizer.eos_token_ids if tokenizer is not None else (),
        kv_cache_dtype,
    )
    num_blocks = _num_kv_blocks(config, runner, device, max_model_len, budget, tp)
    runner.allocate_kv_cache(num_blocks)
    if config.compile:
        from quill.model.compile import compile_runner

        compile_runner(runner, budget)
    _log_pool(config, runner, num_blocks, kv_cache_dtype, max_model_len, budget)
    return ModelExecutor(
        runner,
        tokenizer,
        tok_source,
        loaded.config,
        loaded.hf_config,
        model_path,
        device,
        dtype,
        kv_cache_dtype,
        max_model_len,
        budget,
        num_blocks,
    )


def model_path_of(config: EngineConfig) -> Path:
    if config.model is None:
        from quill.model.default_model import default_model_dir

        return default_model_dir()
    from quill.model.named_models import NAMED_MODELS, named_model_path

    if config.model in NAMED_MODELS:
        return named_model_path(config.model)
    return Path(config.model).expanduser()


def _set_cpu_threads(num_ranks: int = 1) -> None:
    """One compute thread per core this process may use, never more; with several
    tensor-parallel ranks on this host, each takes its share (at least one).

    torch counts the host's physical cores; in a container or under `taskset` the process may
    use fewer, and surplus OpenMP threads then wait on each other at every operator.
    """
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _cgroup_cpu_quota()
    if quota is not None:
        allowed = min(allowed or quota, quota)
    if allowed:
        allowed = max(1, allowed // num_ranks)
        if torch.get_num_threads() > allowed or num_ranks > 1:
            torch.set_num_threads(allowed)
    log.info("compute threads: %d", torch.get_num_threads())


def _cgroup_cpu_quota() -> int | None:
    """CPUs granted by a cgroup v2 quota (`cpu.max`), if one is set."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    return max(1, int(int(quota) / int(period)))


def _quantize(model, method: str, device: torch.device, blocks: dict) -> None:
    from quill.model.linear import choose_native_rows, choose_split
    from quill.model.quant import choose_quantization, quantize_model

    max_rows = None
    if method == "auto":
        method, max_rows = choose_quantization(model, device)
    if method == "none":
        dtype = next(model.parameters()).dtype
        native_rows = choose_native_rows(model) if device.type == "cpu" else 0
        if device.type == "cpu":
            choose_split(model)
        if native_rows:
            log.info(
                "weights: %s, not quantized; quill::dense_linear for steps of up to %d tokens",
                dtype,
                native_rows,
            )
        else:
            log.info("weights: %s, not quantized", dtype)
        return
    # The output head too, in int8: its fp32 sums keep greedy choices (tests/test_quant.py).
    taken = quantize_model(model, method, max_rows, head=True, blocks=blocks)
    if taken:
        log.info(
            "weights: %d tensors taken as the GGUF file stores them (%s)",
            len(taken),
            ", ".join(sorted(set(taken.values()))),
        )
    if max_rows is None:
        log.info("weights: %s weight-only quantization", method)
    else:
        log.info(
            "weights: %s for steps of up to %d tokens (faster here), float above", method, max_rows
        )


def _num_kv_blocks(
    config: EngineConfig, runner: ModelRunner, device, max_model_len: int, budget: int, tp=None
) -> int:
    """Blocks in the pool: rank 0's count for every rank (the scheduler knows one pool)."""
    per_block = runner.kv_bytes_per_block()
    if tp is not None and device.type == "cpu":
        per_block *= tp.local_size  # the ranks on this host share its memory
    per_seq = _blocks_per_seq(config, runner, max_model_len, budget)
    num_blocks = _blocks_for(config, per_block, device, per_seq)
    return num_blocks if tp is None else tp.broadcast_int(num_blocks)


def _blocks_per_seq(config: EngineConfig, runner: ModelRunner, max_model_len: int, budget: int):
    """The most blocks one sequence of full context holds at once, over its KV groups."""
    windows = runner.kv_groups.group_windows
    return peak_blocks(windows, max_model_len, min(budget, max_model_len), config.block_size)


def _blocks_for(config: EngineConfig, per_block: int, device, blocks_per_seq: int) -> int:
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.85)
    else:
        budget = min(int(_available_memory() * 0.25), 4 << 30)
    # No point holding more than every allowed sequence at full context.
    num_blocks = min(budget // per_block, blocks_per_seq * config.max_num_seqs)
    if num_blocks < 1:
        raise InvalidRequestError(
            f"kv_cache_memory {budget} bytes holds no block of {per_block} bytes",
            param="kv_cache_memory",
        )
    return int(num_blocks)


def _log_pool(
    config: EngineConfig, runner: ModelRunner, num_blocks: int, dtype, max_model_len: int, budget
) -> None:
    groups = runner.kv_groups
    log.info(
        "KV cache: %d blocks of %d tokens x %d layers (%.2f GiB, %s; %d KV groups, windows %s); "
        "%.1f sequences of full context (%d tokens) fit",
        num_blocks,
        config.block_size,
        groups.layers_per_block,
        num_blocks * runner.kv_bytes_per_block() / (1 << 30),
        dtype,
        groups.num_groups,
        sorted(set(groups.group_windows)),
        num_blocks / _blocks_per_seq(config, runner, max_model_len, budget),
        max_model_len,
    )


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
