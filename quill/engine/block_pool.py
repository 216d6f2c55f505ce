"""The paged KV cache's bookkeeping: a pool of fixed-size blocks and per-request block tables.

Torch-free: it hands out block ids; the model runner owns the tensors the ids index.
Blocks carry reference counts so that prefix sharing can later map one block into several tables.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


class BlockPool:
    """Fixed set of block ids with reference counts; a block is free when its count is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(n)]
        for b in blocks:
            self.ref_counts[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        for b in blocks:
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} is free and cannot be shared")
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        # Release in reverse so that a request's tail blocks are reused first.
        for b in reversed(blocks):
            if self.ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self._free.append(b)


class KVCacheManager:
    """Maps requests to block tables over a BlockPool."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.block_tables: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) <= self.pool.num_blocks

    def allocate_slots(self, request_id: str, num_tokens_total: int) -> bool:
        """Grow the request's table to hold `num_tokens_total` tokens; False if blocks run out."""
        table = self.block_tables.setdefault(request_id, [])
        needed = self.blocks_for(num_tokens_total) - len(table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free_blocks:
            return False
        table.extend(self.pool.allocate(needed))
        return True

    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table:
            self.pool.free(table)

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])
