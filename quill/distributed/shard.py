"""Megatron's layout for the Llama layers: which slice of every weight a rank keeps.

q/k/v and gate/up are split by output rows (column-parallel: each rank computes its heads and
its part of the MLP's width), o and down by input columns (row-parallel: each rank's product is
a partial sum, all-reduced in the layer). A rank keeps only its KV heads, so its KV cache holds
only those. When the ranks outnumber the KV heads, each KV head is kept by `size / num_kv_heads`
ranks (as vLLM does). The embedding and the output head are kept whole (the head runs on rank 0
only, where sampling is). The model is loaded whole on every rank, then cut: each rank then
quantizes its own slices.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch
from torch import nn

from quill.contract.errors import ModelLoadError
from quill.model.config import ModelConfig, tensor_parallel_problems

if TYPE_CHECKING:
    from quill.distributed.group import TensorParallel


@dataclasses.dataclass(frozen=True)
class RankShard:
    """What rank `rank` of `size` keeps of one layer."""

    heads: range  # query heads
    kv_heads: range
    mlp: range  # columns of the MLP's intermediate width

    @staticmethod
    def of(config: ModelConfig, rank: int, size: int) -> RankShard:
        check_tensor_parallel(config, size)
        heads = config.num_heads // size
        inter = config.intermediate_size // size
        if size <= config.num_kv_heads:
            kv = config.num_kv_heads // size
            kv_heads = range(rank * kv, (rank + 1) * kv)
        else:  # replicated: the KV head this rank's query heads read
            replicas = size // config.num_kv_heads
            kv_heads = range(rank // replicas, rank // replicas + 1)
        query_heads = range(rank * heads, (rank + 1) * heads)
        return RankShard(query_heads, kv_heads, range(rank * inter, (rank + 1) * inter))


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Raise ModelLoadError, naming the numbers, unless `size` ranks can split this model."""
    if size < 1:
        raise ModelLoadError(f"tensor_parallel_size must be at least 1, got {size}")
    if size > 1 and config.family == "gemma3":
        raise ModelLoadError("tensor parallelism is not supported for Gemma 3 (one rank)")
    if size > 1 and config.moe is not None:
        raise ModelLoadError(
            "tensor parallelism over a sparse MLP's experts is not supported: serve "
            f"{config.architecture} on one rank (tensor_parallel_size 1)"
        )
    shape = (config.num_heads, config.num_kv_heads, config.intermediate_size)
    problems = tensor_parallel_problems(*shape, size)
    if problems:
        can = [n for n in range(1, config.num_heads + 1) if not tensor_parallel_problems(*shape, n)]
        raise ModelLoadError(
            f"tensor_parallel_size {size} cannot split this model: {'; '.join(problems)} "
            f"(sizes that can: {', '.join(map(str, can))})"
        )


def shard_model(model: nn.Module, tp: TensorParallel) -> ModelConfig:
    """Cut every layer of a whole model down to rank `tp.rank`'s slices, in place; returns the
    rank's view of the config (its head counts and MLP width), which sizes its KV cache."""
    config: ModelConfig = model.config
    shard = RankShard.of(config, tp.rank, tp.size)
    d = config.head_dim
    q_all, kv_all = config.num_heads * d, config.num_kv_heads * d
    inter_all = config.intermediate_size
    q_rows = _rows(shard.heads, d)
    k_rows = _rows(shard.kv_heads, d, q_all)
    v_rows = _rows(shard.kv_heads, d, q_all + kv_all)
    gate_rows = torch.arange(shard.mlp.start, shard.mlp.stop)
    up_rows = gate_rows + inter_all
    for layer in model.layers:
        _keep_rows(layer.qkv_proj, torch.cat([q_rows, k_rows, v_rows]))
        layer.qkv_proj.parts = [len(q_rows), len(k_rows), len(v_rows)]
        _keep_columns(layer.o_proj, q_rows, tp.rank)
        _keep_rows(layer.gate_up_proj, torch.cat([gate_rows, up_rows]))
        layer.gate_up_proj.parts = [len(gate_rows), len(up_rows)]
        _keep_columns(layer.down_proj, gate_rows, tp.rank)
        layer.num_heads, layer.num_kv_heads = len(shard.heads), len(shard.kv_heads)
        layer.q_size, layer.kv_size = len(q_rows), len(k_rows)
        layer.tp = tp
    local = dataclasses.replace(
        config,
        num_heads=len(shard.heads),
        num_kv_heads=len(shard.kv_heads),
        intermediate_size=len(shard.mlp),
    )
    model.config = local
    return local


def _rows(heads: range, head_dim: int, offset: int = 0) -> torch.Tensor:
    return torch.arange(heads.start * head_dim, heads.stop * head_dim) + offset


def _keep_rows(linear: nn.Linear, rows: torch.Tensor) -> None:
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[rows].contiguous(), requires_grad=False)
        if linear.bias is not None:
            linear.bias = nn.Parameter(linear.bias[rows].contiguous(), requires_grad=False)
    linear.out_features = len(rows)


def _keep_columns(linear: nn.Linear, columns: torch.Tensor, rank: int) -> None:
    with torch.no_grad():
        linear.weight = nn.Parameter(linear.weight[:, columns].contiguous(), requires_grad=False)
        if linear.bias is not None and rank != 0:  # the sum of the ranks adds it once
            linear.bias.zero_()
    linear.in_features = len(columns)
