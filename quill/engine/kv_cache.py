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

A model of several KV groups (quill/contract/kv_groups.py: sliding-window layers beside global
ones) gives each request one table per group over the one pool. A sliding group's blocks behind
its window go back to the pool as the request grows (their cached content stays until evicted),
and a cached prefix counts for it only if the blocks its next token's window reads are cached.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from quill.contract.kv_groups import NULL_BLOCK, first_needed_block, peak_blocks
from quill.engine.block_pool import BlockPool
from quill.engine.request import Request


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The hash of a full block of `token_ids` that follows the prefix hashed as `parent`."""
    return hashlib.sha256(parent + array("q", token_ids).tobytes()).digest()


# hash_block, or another function of the same shape (the simulator's, whose hashes are ints:
# quill/sim/replica.py).
# Its `parent` is a chain's root (chain_root) or the hash it gave the block before.
BlockHasher = Callable[[bytes | int, Sequence[int]], bytes | int]


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
    """Maps requests to block tables (one per KV group) over a BlockPool, sharing cached full
    blocks."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = False,
        group_windows: Sequence[int] = (0,),
        block_hasher: BlockHasher = hash_block,
    ) -> None:
        self.block_size = block_size
        self.hash_block = block_hasher
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.group_windows = tuple(group_windows)  # KVGroups.group_windows (0: global)
        self._global_groups = [g for g, w in enumerate(self.group_windows) if not w]
        self._sliding_groups = [g for g, w in enumerate(self.group_windows) if w]
        # A request's tables, one per group, all of one length: entry i holds tokens
        # i * block_size ... (NULL_BLOCK: freed, behind a sliding group's window).
        self.block_tables: dict[str, list[list[int]]] = {}
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

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    def peak_blocks(self, num_tokens: int, chunk_tokens: int | None = None) -> int:
        """Blocks a request of `num_tokens` tokens, computed at most `chunk_tokens` a step,
        holds at once over its tables."""
        chunk = num_tokens if chunk_tokens is None else chunk_tokens
        return peak_blocks(self.group_windows, num_tokens, chunk, self.block_size)

    def can_ever_fit(self, num_tokens: int, chunk_tokens: int | None = None) -> bool:
        return self.peak_blocks(num_tokens, chunk_tokens) <= self.pool.num_blocks

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        tables = self.block_tables.get(request_id)
        return tables[group] if tables else []

    def _key(self, group: int, block_hash: bytes) -> bytes | tuple[bytes, int]:
        """A group's blocks hold other layers' keys than the same tokens' blocks of another
        group: the cache tells them apart (a first-group key is the bare hash, the only kind
        of key that is no tuple: the one KV-cache events tell of)."""
        return block_hash if group == 0 else (block_hash, group)

    # -- prefix caching -------------------------------------------------------------------
    def block_hashes(self, request: Request, num_blocks: int) -> list[bytes]:
        """The request's first `num_blocks` full-block hashes (kept on the request, extended
        as its tokens grow)."""
        hashes = request.block_hashes
        if len(hashes) < num_blocks:
            size, hash_of, append = self.block_size, self.hash_block, hashes.append
            prompt = request.prompt_token_ids
            parent = hashes[-1] if hashes else chain_root(request.cache_salt)
            first, stop = len(hashes) * size, num_blocks * size
            prompt_end = min(stop, len(prompt) // size * size)  # its full blocks of prompt alone
            for begin in range(first, prompt_end, size):  # most blocks: a slice of the prompt
                parent = hash_of(parent, prompt[begin : begin + size])
                append(parent)
            for begin in range(max(first, prompt_end), stop, size):
                parent = hash_of(parent, request.token_ids_slice(begin, begin + size))
                append(parent)
        return hashes

    def find_cached_prefix(self, request: Request) -> list[list[int]]:
        """Each group's blocks holding the longest cached prefix of the request's tokens, short
        of its last token and of what it may reuse (all of one length; a sliding group's
        blocks that its next token's window does not reach are NULL_BLOCK). Changes nothing:
        `allocate_slots` takes them."""
        if not self.enable_prefix_caching:
            return [[] for _ in self.group_windows]
        lookup, key = self.pool.lookup, self._key
        num_blocks = (request.num_tokens - 1) // self.block_size
        reusable = request.num_reusable_tokens
        if reusable is not None:  # it scores its prompt: what it has not scored is computed
            num_blocks = min(num_blocks, reusable // self.block_size)
        hashes = self.block_hashes(request, num_blocks)
        found: list[list[int | None]] = [[] for _ in self.group_windows]
        limit = len(hashes)
        for g in self._global_groups:
            for block_hash in hashes[:limit]:
                block = lookup(key(g, block_hash))
                if block is None:
                    break
                found[g].append(block)
            limit = len(found[g])
        if self._sliding_groups:
            for g in self._sliding_groups:
                found[g] = [lookup(key(g, h)) for h in hashes[:limit]]
            limit = self._sliding_prefix(found, limit)
            for g in self._sliding_groups:
                first = self._first_needed(g, limit * self.block_size)
                found[g] = [NULL_BLOCK] * first + found[g][first:limit]
        return [blocks[:limit] for blocks in found]

    def _sliding_prefix(self, found: list[list[int | None]], limit: int) -> int:
        """The most blocks, up to `limit`, whose following token finds every block its window
        reads cached in each sliding group."""
        for length in range(limit, 0, -1):
            position = length * self.block_size
            if all(
                None not in found[g][self._first_needed(g, position) : length]
                for g in self._sliding_groups
            ):
                return length
        return 0

    def _first_needed(self, group: int, position: int) -> int:
        return first_needed_block(self.group_windows[group], position, self.block_size)

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
        cache, events = self.pool.cache, self.pool.events
        tables = self.block_tables[rid]
        table = tables[0]  # the first group's: its key is the bare hash, and events tell of it
        for i in range(done, full):
            if table[i] != NULL_BLOCK and cache(table[i], hashes[i]) and events is not None:
                parent = hashes[i - 1] if i else (chain_root(request.cache_salt) or None)
                size = self.block_size
                events.stored(hashes[i], parent, request.token_ids_slice(i * size, (i + 1) * size))
        for g in range(1, len(tables)):
            table = tables[g]
            for i in range(done, full):
                if table[i] != NULL_BLOCK:
                    cache(table[i], self._key(g, hashes[i]))
        self._num_registered[rid] = full

    # -- tables ---------------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_tokens: int, cached_blocks: Sequence[Sequence[int]] = ()
    ) -> bool:
        """Grow the request's tables to hold `num_tokens` tokens, starting them with
        `cached_blocks` (from `find_cached_prefix`, for a request with no table yet); False,
        with nothing changed but blocks behind its windows freed, if the pool is short."""
        rid = request.request_id
        tables = self.block_tables.get(rid)
        pool = self.pool
        if tables is None:
            tables = self.block_tables[rid] = [[] for _ in self.group_windows]
        elif self._sliding_groups:
            self._free_behind_windows(tables, request.num_computed_tokens)
        elif not cached_blocks:  # a running request grows (every decode that fills a block)
            needed = -(-num_tokens // self.block_size) - len(tables[0])
            if needed <= 0:
                return True
            if needed * len(tables) > pool.num_free_blocks:
                return False
            for table in tables:
                table.extend(pool.allocate(needed))
            return True
        num_cached = len(cached_blocks[0]) if cached_blocks else 0
        needed = self.blocks_for(num_tokens) - len(tables[0]) - num_cached
        revived = self._revived(cached_blocks)
        if max(needed, 0) * len(tables) + revived > pool.num_free_blocks:
            return False
        if num_cached:
            for table, blocks in zip(tables, cached_blocks, strict=True):
                pool.take([b for b in blocks if b != NULL_BLOCK])
                table.extend(blocks)
            self._num_registered[rid] = num_cached
        if needed > 0:
            for table in tables:
                table.extend(pool.allocate(needed))
        return True

    def _revived(self, cached_blocks: Sequence[Sequence[int]]) -> int:
        """Cached blocks that would leave the free list if a request took them."""
        ref_counts = self.pool.ref_counts
        return sum(1 for bs in cached_blocks for b in bs if b >= 0 and ref_counts[b] == 0)

    def reach(self, request: Request, cached_blocks: Sequence[Sequence[int]] = ()) -> int:
        """How many tokens the request's tables could hold, grown into every free block now
        (after an `allocate_slots` that failed, which freed what lay behind its windows)."""
        tables = self.block_tables.get(request.request_id)
        held = len(tables[0]) if tables else 0
        num_cached = len(cached_blocks[0]) if cached_blocks else 0
        spare = self.pool.num_free_blocks - self._revived(cached_blocks)
        return (held + num_cached + max(spare, 0) // self.num_groups) * self.block_size

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Give back the request's blocks past those holding its first `num_tokens` tokens
        (booked for drafts that were rejected; never cached: only verified blocks are)."""
        tables = self.block_tables.get(request_id)
        keep = self.blocks_for(num_tokens)
        if not tables or len(tables[0]) <= keep:
            return
        for table in tables:
            self.pool.free([b for b in table[keep:] if b != NULL_BLOCK])
            del table[keep:]

    def _free_behind_windows(self, tables: list[list[int]], position: int) -> None:
        """Free each sliding group's blocks that no query from `position` on reads."""
        for g in self._sliding_groups:
            table = tables[g]
            i = self._first_needed(g, position) - 1
            freed = []
            while i >= 0 and table[i] != NULL_BLOCK:  # the freed ones are a prefix
                freed.append(table[i])
                table[i] = NULL_BLOCK
                i -= 1
            if freed:
                self.pool.free(freed[::-1])

    # -- leases ---------------------------------------------------------------------------
    def lease(self, request_id: str, num_tokens: int, expires_at: float) -> KVLease | None:
        """Keep the blocks holding a finished request's first `num_tokens` tokens (the rest
        of its table is freed) until `release` or `expires_at`."""
        tables = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not tables:
            return None
        if len(tables) > 1:
            raise ValueError("a KV lease holds one group's table (disaggregation refuses more)")
        table = tables[0]
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
        tables = self.block_tables.pop(request_id, None)
        self._num_registered.pop(request_id, None)
        if not tables:
            return
        for table in tables:
            if self._sliding_groups:
                table = [b for b in table if b != NULL_BLOCK]
            if uncache:
                self.pool.uncache([b for b in table if self.pool.ref_counts[b] == 1])
            self.pool.free(table)
