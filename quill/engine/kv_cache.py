"""Block tables over the block pool, and automatic prefix caching. No torch.

A full block is named by a hash chained over its tokens and its prefix's hash, so equal hashes
mean equal tokens at equal positions after an equal prefix, hence equal keys and values (one
engine serves one model; a request's `cache_salt` starts its chain elsewhere, so requests with
different salts never share). SHA-256, not Python's `hash`: a collision would hand one user's
cached state to another, and Python's hash of small ints is easy to collide on purpose.

A request's blocks are registered as soon as a step is scheduled to fill them: the model writes
every token's keys and values in a layer before any attention in that layer reads the cache, so
a request admitted in the same step (the other `n - 1` samples of one prompt) can already map
them. A new request maps the longest chain of cached blocks that leaves its last token to
compute (a step must sample from something), and computes only the rest.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from quill.engine.block_pool import BlockPool
from quill.engine.request import Request


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block of `token_ids` that follows the prefix hashed as `parent`."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


def chain_root(cache_salt: str | None) -> bytes:
    """The `parent` of a request's first block."""
    if cache_salt is None:
        return b""
    return hashlib.sha256(b"quill-cache-salt:" + cache_salt.encode()).digest()


@dataclass
class PrefixCacheStats:
    """Counted once per admission of a request (a preempted request counts again)."""

    queries: int = 0  # tokens looked up
    hits: int = 0  # of them, tokens found cached


@dataclass
class KVLease:
    """A finished request's blocks, kept for a decode instance to fetch (disaggregation)."""

    block_ids: list[int]  # in order: block i holds tokens i * block_size ...
    num_tokens: int  # tokens whose keys and values the blocks hold
    expires_at: float  # freed then, fetched or not


class KVCacheManager:
    """Maps requests to block tables over a BlockPool, sharing cached full blocks."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._num_registered: dict[str, int] = {}  # leading blocks of a table already cached
        self.stats = PrefixCacheStats()
        self.leases: dict[str, KVLease] = {}  # by request id
        # Held to take a lease away: a KV server thread copies a lease's blocks under it.
        self.lease_lock = threading.Lock()
        self.num_lease_expiries = 0

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

    def block_table(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    # -- prefix caching -------------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's first `num_blocks` full-block hashes (kept on the request, extended
        as its tokens grow)."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            size = self.block_size
            parent = hashes[-1] if hashes else chain_root(request.cache_salt)
            for i in range(len(hashes), num_blocks):
                parent = hash_block(parent, request.token_ids_slice(i * size, (i + 1) * size))
                hashes.append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[int]:
        """Blocks holding the longest cached prefix of the request's tokens, short of its last
        token. Changes nothing: `allocate_slots` takes them."""
        if not self.enable_prefix_caching:
            return []
        lookup = self.pool.lookup
        found = []
        for block_hash in self.block_hashes(request, (request.num_tokens - 1) // self.block_size):
            block = lookup(block_hash)
            if block is None:
                break
            found.append(block)
        return found

    def record_lookup(self, num_tokens: int, num_cached_tokens: int) -> None:
        self.stats.queries += num_tokens
        self.stats.hits += num_cached_tokens

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full once its first `num_tokens` tokens are
        computed."""
        rid = request.request_id
        full = num_tokens // self.block_size
        done = self._num_registered.get(rid, 0)
        if full <= done or not self.enable_prefix_caching:
            return
        hashes = self.block_hashes(request, full)
        table = self.block_tables[rid]
        cache = self.pool.cache
        for i in range(done, full):
            cache(table[i], hashes[i])
        self._num_registered[rid] = full

    # -- tables ---------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Grow the request's table to hold `num_tokens` tokens, starting it with
        `cached_blocks` (from `find_cached_prefix`, for a request with no table yet); False,
        with nothing changed, if the pool is short."""
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is None:
            table = self.block_tables[rid] = []
        pool = self.pool
        needed = self.blocks_for(num_tokens) - len(table) - len(cached_blocks)
        revived = sum(1 for b in cached_blocks if pool.ref_counts[b] == 0)  # leave the free list
        if max(needed, 0) + revived > pool.num_free_blocks:
            return False
        if cached_blocks:
            pool.take(list(cached_blocks))
            table.extend(cached_blocks)
            self._num_registered[rid] = len(cached_blocks)
        if needed > 0:
            table.extend(pool.allocate(needed))
        return True

    # -- leases ---------------------------------------------------------------------------
    def lease(self, request_id: str, num_tokens: int, expires_at: float) -> KVLease | None:
        """Keep the blocks holding a finished request's first `num_tokens` tokens (the rest
        of its table is freed) until `release` or `expires_at`."""
        table = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not table:
            return None
        keep = self.blocks_for(num_tokens)
        if keep < len(table):
            self.pool.free(table[keep:])
        lease = self.leases[request_id] = KVLease(table[:keep], num_tokens, expires_at)
        return lease

    def release(self, request_id: str) -> bool:
        """Free a lease's blocks (fetched, or given up); False if there was none."""
        with self.lease_lock:
            lease = self.leases.pop(request_id, None)
        if lease is None:
            return False
        self.pool.free(lease.block_ids)
        return True

    def expire_leases(self, now: float) -> list[str]:
        """Free the leases past their time; their request ids."""
        expired = [rid for rid, lease in self.leases.items() if lease.expires_at <= now]
        for rid in expired:
            self.release(rid)
        self.num_lease_expiries += len(expired)
        return expired

    def free(self, request_id: str, uncache: bool = False) -> None:
        """Release the request's blocks; their cached content stays for others unless
        `uncache` (the request failed, so what its last step wrote is not to be trusted: the
        blocks only it holds are forgotten)."""
        table = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not table:
            return
        if uncache:
            self.pool.uncache([b for b in table if self.pool.ref_counts[b] == 1])
        self.pool.free(table)
