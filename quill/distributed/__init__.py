"""Tensor parallelism on torch.distributed: the rank group, the sharded model, the executor.

Every rank holds a slice of each layer (Megatron's layout) and the ranks sum their partial
results with all-reduces over a torch.distributed process group (gloo on the CPU, NCCL on
CUDA). Rank 0 lives in the engine's process and is its executor: it sends each step plan to
the other ranks, runs its own slice, and samples.
"""
