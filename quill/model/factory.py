"""Builds what runs the steps: loads the model, sizes the KV pool, makes the torch executor.

The engine core takes an executor and a pool size and nothing else; everything that needs torch
to decide (device, dtype, free memory, the model's KV bytes per block) is settled here.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.config import EngineConfig
from quill.contract.errors import InvalidRequestError
from quill.contract.kv_format import AUTO_RULE, KVCacheFormat
from quill.contract.kv_groups import peak_blocks
from quill.frontend.tokenizer import Tokenizer
from quill.model.config import ModelConfig, generation_config_eos_ids
from quill.model.loader import (
    load_model,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from quill.model.memory_plan import COPIES_SHARE, STORED_COPY_SHARE, available_memory
from quill.model.pooled_head import read_pooled_head
from quill.model.runner import ModelRunner
from quill.ops.memory import return_freed_memory

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
    kv_format: KVCacheFormat
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
    # `auto` uses a GGUF file's K-quant tensors where they lie (quill/model/stored.py);
    # a method asked for by name is applied to the floats, as before.
    keep_stored = config.quantization == "auto" and tp is None
    plan = _plan(config, model_path, dtype, device, keep_stored, tp)
    loaded = load_model(model_path, config.load_format, dtype, device, keep_stored=keep_stored,
                        map_floats=tp is None)  # fmt: skip
    blocks = loaded.blocks
    if tp is not None:
        tp.shard(loaded.model)
        blocks = {}  # each rank quantizes its own slices from the floats
    encoder = not loaded.config.causal
    if encoder:  # small models whose products are few: kept in their floats
        log.info("weights: %s, an encoder kept in its floats (quantization %r not applied)",
                 dtype, config.quantization)  # fmt: skip
    else:
        _quantize(loaded.model, config.quantization, device, blocks, plan, loaded.unloaded)
    if loaded.mapped:  # the files' pages of weights quantized without a float copy go
        from quill.model.loader import release_unused

        release_unused(loaded.model, loaded.mapped)
    del blocks
    loaded.blocks = {}  # held in the weights now: the decoded copies go
    return_freed_memory()
    tok_source = Path(config.tokenizer) if config.tokenizer else loaded.source
    tokenizer = None  # ranks past 0 neither sample nor hold back end tokens
    if tp is None or tp.is_driver:
        declared_ends = loaded.config.eos_token_ids + generation_config_eos_ids(loaded.source)
        tokenizer = Tokenizer.load(tok_source, declared_ends)
    ctx = _longest_input(loaded.config, loaded.source)
    max_model_len = min(config.max_model_len or ctx, ctx)
    # An encoder's steps have no decodes waiting on them: larger products pay (1,000 MiniLM
    # texts: 512 tokens a step 121 texts/s, 4096 176 in bf16; docs/benchmarks.md).
    budget = config.max_num_batched_tokens or (
        4096 if encoder else 512 if device.type == "cpu" else 8192
    )
    kv_format = resolve_kv_cache_dtype(
        config.kv_cache_dtype, dtype, device, dtype_asked=config.dtype != "auto"
    )
    if config.kv_cache_dtype == "auto" and kv_format.bytes_per_element == 2:
        log.info("KV cache: %s", AUTO_RULE)
    runner = ModelRunner(
        loaded.model,
        device,
        dtype,
        config.block_size,
        config.seed,
        tokenizer.eos_token_ids if tokenizer is not None else (),
        kv_format,
        read_pooled_head(loaded.source) if encoder else None,
    )
    default_kv = plan.kv_budget() if plan is not None and device.type == "cpu" else None
    if encoder:  # no KV: the blocks only count what the scheduler admits
        num_blocks = config.max_num_seqs * -(-max_model_len // config.block_size)
    else:
        num_blocks = _num_kv_blocks(config, runner, device, max_model_len, budget, tp, default_kv)
    if config.max_model_len is None and config.kv_cache_memory is None and not encoder:
        max_model_len = _clamp_context(config, runner, num_blocks, max_model_len, budget)
    runner.allocate_kv_cache(num_blocks)
    if config.compile and not encoder:
        from quill.model.compile import compile_runner

        compile_runner(runner, budget)
    _log_pool(config, runner, num_blocks, kv_format, max_model_len, budget)
    return ModelExecutor(
        runner,
        tokenizer,
        tok_source,
        loaded.config,
        loaded.hf_config,
        model_path,
        device,
        dtype,
        kv_format,
        max_model_len,
        budget,
        num_blocks,
    )


def _longest_input(model_config: ModelConfig, source: Path) -> int:
    """The model's context: its positions, or for a sentence-transformers model the length it
    was trained to embed (`max_seq_length`; sentence-transformers cuts longer texts there,
    quill refuses them unless truncate_prompt_tokens asks)."""
    ctx = model_config.max_position_embeddings
    try:
        st = json.loads((source / "sentence_bert_config.json").read_text())
    except (OSError, ValueError):
        return ctx
    return min(ctx, int(st.get("max_seq_length") or ctx))


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


def _quantize(
    model, method: str, device: torch.device, blocks: dict, plan=None, unloaded=frozenset()
) -> None:
    """`unloaded`: parameters loaded only as their GGUF blocks (Q8_0, Q4_x), made int8 / int4
    from them whatever is chosen for the rest."""
    from quill.model.linear import choose_native_rows, choose_split
    from quill.model.quant import choose_quantization, keep_block_float_copies, quantize_model
    from quill.model.stored import StoredLinear
    from quill.model.stored_timing import choose_dequantized_products, keep_float_copies

    stored = [m for m in model.modules() if isinstance(m, StoredLinear)]
    if stored:
        types: dict[str, int] = {}
        for m in stored:
            for s in m.segments:
                types[s.type_name] = types.get(s.type_name, 0) + s.nbytes
        log.info(
            "weights: %d products used as the GGUF file stores them, in place or in tiles (%s)",
            len(stored),
            ", ".join(f"{t} {b / (1 << 20):.0f} MiB" for t, b in sorted(types.items())),
        )
        if device.type == "cpu" and plan is not None:
            dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
            _, copies = keep_float_copies(model, dtype, int(STORED_COPY_SHARE * plan.available))
            plan.weights += copies  # the KV pool is sized from what is left
            plan.parts["float copies"] = copies
            if not copies:
                choose_dequantized_products(model, dtype)
    if unloaded:
        taken = quantize_model(model, None, head=True, blocks=blocks, unloaded=unloaded)
        log.info(
            "weights: %d products made from the GGUF file's %s blocks alone (no floats loaded)",
            len(taken),
            "/".join(sorted(set(taken.values()))),
        )
    if not any(isinstance(m, torch.nn.Linear) for m in model.modules()):
        return  # every product is stored: nothing to quantize or to choose
    max_rows = None
    if method == "auto":
        method, max_rows = choose_quantization(model, device)
        if max_rows is not None and plan is not None and not plan.copies_fit():
            log.info(
                "weights: the float copy for large steps is not kept: float and int8 together "
                "(%.2f GiB) pass %.0f%% of the %.2f GiB available; int8 for every step",
                (plan.parts["floats"] + plan.parts["int8 copies"]) / (1 << 30),
                100 * COPIES_SHARE,
                plan.available / (1 << 30),
            )
            max_rows = None
        if max_rows is not None and unloaded and plan is not None:
            dtype = next(p for p in model.parameters() if p.is_floating_point()).dtype
            budget = int(STORED_COPY_SHARE * plan.available) - plan.parts.get("float copies", 0)
            copies = keep_block_float_copies(model, max_rows, dtype, budget)
            plan.weights += copies  # the KV pool is sized from what is left
            plan.parts["float copies"] = plan.parts.get("float copies", 0) + copies
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


def _plan(config: EngineConfig, model_path: Path, dtype, device, keep_stored: bool, tp):
    """The weights' memory, checked against the machine before loading (one process's model:
    tensor-parallel ranks divide it, and are planned by their own memory)."""
    if tp is not None:
        return None
    from quill.cost.model import ModelSpec
    from quill.model.loader import _read_config
    from quill.model.memory_plan import MIN_CONTEXT, plan_memory

    hf_config, _ = _read_config(model_path, config.load_format)
    model_config = ModelConfig.from_hf_dict(hf_config)
    num_params = ModelSpec.from_hf_config(hf_config).num_params
    # An encoder is kept in its floats (build_model_executor): no quantized copies.
    quantization = config.quantization if model_config.causal else "none"
    plan = plan_memory(model_path, config.load_format, num_params, dtype.itemsize, device,
                       keep_stored, quantization)  # fmt: skip
    kv_format = resolve_kv_cache_dtype(config.kv_cache_dtype, dtype, device, config.dtype != "auto")
    per_token = model_config.kv_bytes_per_token * kv_format.bytes_per_element
    ctx = min(config.max_model_len or model_config.max_position_embeddings,
              model_config.max_position_embeddings)  # fmt: skip
    min_tokens = min(ctx, MIN_CONTEXT)
    min_kv = config.kv_cache_memory or min_tokens * per_token
    plan.check(model_path.name, min_kv, min_tokens)
    log.info("memory: %s; %.2f GiB available", plan.describe(), plan.available / (1 << 30))
    return plan


def _clamp_context(config: EngineConfig, runner: ModelRunner, num_blocks: int, ctx: int,
                   budget: int) -> int:  # fmt: skip
    """The longest context one sequence can hold in this pool (ctx if it holds that)."""
    if _blocks_per_seq(config, runner, ctx, budget) <= num_blocks:
        return ctx
    low, high = config.block_size, ctx  # holds `low`, not `high`
    while high - low > 1:
        mid = (low + high) // 2
        if _blocks_per_seq(config, runner, mid, budget) <= num_blocks:
            low = mid
        else:
            high = mid
    log.warning(
        "max_model_len: the KV pool (%d blocks) holds one sequence of %d tokens, not the "
        "model's %d: max_model_len is %d (set kv_cache_memory, or max_model_len, to choose)",
        num_blocks,
        low,
        ctx,
        low,
    )
    return low


def _num_kv_blocks(
    config: EngineConfig,
    runner: ModelRunner,
    device,
    max_model_len: int,
    budget: int,
    tp=None,
    default_kv: int | None = None,
) -> int:
    """Blocks in the pool: rank 0's count for every rank (the scheduler knows one pool).
    `default_kv`: the pool's bytes when kv_cache_memory is not given (the memory plan's)."""
    per_block = runner.kv_bytes_per_block()
    if tp is not None and device.type == "cpu":
        per_block *= tp.local_size  # the ranks on this host share its memory
    per_seq = _blocks_per_seq(config, runner, max_model_len, budget)
    num_blocks = _blocks_for(config, per_block, device, per_seq, default_kv)
    return num_blocks if tp is None else tp.broadcast_int(num_blocks)


def _blocks_per_seq(config: EngineConfig, runner: ModelRunner, max_model_len: int, budget: int):
    """The most blocks one sequence of full context holds at once, over its KV groups."""
    windows = runner.kv_groups.group_windows
    return peak_blocks(windows, max_model_len, min(budget, max_model_len), config.block_size)


def _blocks_for(
    config: EngineConfig, per_block: int, device, blocks_per_seq: int, default: int | None = None
) -> int:
    if config.kv_cache_memory is not None:
        budget = config.kv_cache_memory
    elif default is not None:
        budget = default
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * 0.85)
    else:
        budget = min(int(available_memory(device) * 0.25), 4 << 30)
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
    if runner.encoder:
        return  # no KV cache (the runner said so)
    groups = runner.kv_groups
    log.info(
        "KV cache: %d blocks of %d tokens x %d layers (%.2f GiB, %s; %d KV groups, windows %s): "
        "%d tokens of KV; %.1f sequences of full context (%d tokens) fit",
        num_blocks,
        config.block_size,
        groups.layers_per_block,
        num_blocks * runner.kv_bytes_per_block() / (1 << 30),
        dtype,
        groups.num_groups,
        sorted(set(groups.group_windows)),
        num_blocks * config.block_size // groups.num_groups,
        num_blocks / _blocks_per_seq(config, runner, max_model_len, budget),
        max_model_len,
    )
