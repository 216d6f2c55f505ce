"""One process's place in a tensor-parallel group, passed to the model as an argument.

The layers that need the group (the row-parallel products' all-reduce) hold this object, so no
module reads global state to find its ranks. The collectives run on the group torch.distributed
was initialised with (gloo on the CPU, NCCL on CUDA, with a gloo group for the plans there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from quill.distributed.ports import free_port  # noqa: F401 - the ranks' rendezvous port


@dataclass
class TensorParallel:
    """Rank `rank` of `size`; `group` carries the model's collectives, `control` the plans."""

    rank: int
    size: int
    local_size: int = 1  # the ranks on this host, which share its cores and memory
    group: object = field(default=None, repr=False)
    control: object = field(default=None, repr=False)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def shard(self, model) -> None:
        """Cut a whole model down to this rank's slices (quill/distributed/shard.py)."""
        from quill.distributed.shard import shard_model

        shard_model(model, self)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def broadcast_bytes(self, data: bytes | None) -> bytes | None:
        """Rank 0 sends `data` (None: the end), the others get it (None at the end)."""
        size = torch.tensor([-1 if data is None else len(data)], dtype=torch.long)
        dist.broadcast(size, 0, group=self.control)
        n = int(size.item())
        if n < 0:
            return None
        buffer = (
            torch.frombuffer(bytearray(data), dtype=torch.uint8)
            if data is not None
            else torch.empty(n, dtype=torch.uint8)
        )
        if n:
            dist.broadcast(buffer, 0, group=self.control)
        return data if data is not None else buffer.numpy().tobytes()

    def broadcast_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.long)
        dist.broadcast(t, 0, group=self.control)
        return int(t.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(
    rank: int, size: int, address: str, device: torch.device, timeout_s: float, local_size: int
) -> TensorParallel:
    """Initialise torch.distributed for this rank (`address`: host:port of rank 0's store).
    A collective that waits longer than `timeout_s` raises, so a rank that hangs is seen in
    bounded time (one that dies is seen at once: its sockets close)."""
    if dist.is_initialized():
        raise RuntimeError(
            "a tensor-parallel engine already runs in this process: close() it before starting "
            "another"
        )
    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(
        backend, init_method=f"tcp://{address}", rank=rank, world_size=size, timeout=timeout,
        **kwargs,
    )  # fmt: skip
    group = dist.group.WORLD
    # Plans are bytes on the host: on CUDA they travel over a gloo group beside NCCL's.
    control = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else group
    return TensorParallel(rank, size, local_size, group, control)
