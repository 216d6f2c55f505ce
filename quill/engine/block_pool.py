"""The paged KV cache's blocks: reference counts, the free list, and the cache of full blocks.

Torch-free: it hands out block ids; the model runner owns the tensors the ids index.

A block whose count falls to 0 is free, but if it holds a full block of known content (its hash
is registered) it keeps that content until the pool needs a fresh block: a later request with
the same prefix takes it back instead of computing it again. Free blocks wait in one queue,
least recently used first; a block without cached content goes to the front, since nothing is
lost by reusing it. Only a free block is ever evicted, so a block in some table keeps its
content.
"""

from __future__ import annotations

from collections import OrderedDict

from quill.engine.kv_events import KVEventLog


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are asked for than the pool has free."""


class BlockPool:
    """Fixed set of block ids with reference counts; a block is free when its count is 0."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"the KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # The key of the full block a block holds, when it is registered in `cached`: its hash,
        # or (hash, group) for a later KV group's (quill/engine/kv_cache.KVCacheManager._key).
        self.block_hashes: list[bytes | int | tuple | None] = [None] * num_blocks
        self.cached: dict[bytes | int | tuple, int] = {}  # content key -> the block holding it
        # Free blocks in eviction order (an OrderedDict pops and unlinks from the middle in O(1)).
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_evictions = 0
        # Told of every first-group block registered or forgotten (quill/engine/kv_events.py).
        self.events: KVEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Share of the pool in some table (free blocks that keep cached content count as
        free: they are handed out on demand)."""
        return 1.0 - len(self._free) / self.num_blocks

    def is_free(self, block: int) -> bool:
        return block in self._free

    def allocate(self, n: int) -> list[int]:
        """`n` fresh blocks; a block taken from the cache loses its cached content."""
        free = self._free
        if n > len(free):
            raise NoFreeBlocksError(f"asked for {n} blocks, {len(free)} free")
        pop, ref_counts, hashes = free.popitem, self.ref_counts, self.block_hashes
        blocks = []
        evicted = 0
        for _ in range(n):  # a plain loop: most calls take one block (a decode's next)
            b = pop(False)[0]
            blocks.append(b)
            ref_counts[b] = 1
            if hashes[b] is not None:
                self._uncache(b)
                evicted += 1
        self.num_evictions += evicted
        return blocks

    def take(self, blocks: list[int]) -> None:
        """Add a reference to each block (cached ones found for a prefix, which may be free)."""
        for b in blocks:
            if self.ref_counts[b] == 0:
                if self.block_hashes[b] is None:
                    raise ValueError(f"block {b} is free and holds nothing to share")
                del self._free[b]
            self.ref_counts[b] += 1

    def free(self, blocks: list[int]) -> None:
        # Release in reverse so that a request's tail blocks are evicted before its head:
        # the head is the part other requests are likely to share.
        ref_counts, hashes, free = self.ref_counts, self.block_hashes, self._free
        for b in reversed(blocks):
            count = ref_counts[b] - 1
            if count < 0:
                raise ValueError(f"block {b} freed twice")
            ref_counts[b] = count
            if count == 0:
                free[b] = None
                if hashes[b] is None:
                    free.move_to_end(b, last=False)

    # -- the cache of full blocks ---------------------------------------------------------
    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def cache(self, block: int, block_hash: bytes) -> bool:
        """Register `block` as holding the full block `block_hash` (its KV is computed, or is
        computed by the step about to run). A second copy of known content stays unregistered
        (False)."""
        if block_hash not in self.cached and self.block_hashes[block] is None:
            self.cached[block_hash] = block
            self.block_hashes[block] = block_hash
            return True
        return False

    def uncache(self, blocks: list[int]) -> None:
        """Forget what these blocks hold (their KV may be wrong: the step that wrote it failed)."""
        for b in blocks:
            if self.block_hashes[b] is not None:
                self._uncache(b)
                if self.ref_counts[b] == 0:
                    self._free.move_to_end(b, last=False)

    def _uncache(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        del self.cached[block_hash]
        self.block_hashes[block] = None
        if self.events is not None and type(block_hash) is not tuple:  # the first group's
            self.events.removed(block_hash)
