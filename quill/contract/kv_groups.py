"""How a model's layers share the KV block pool: groups of layers with one block table each.

A layer with a sliding window needs only its window's keys, so its blocks behind the window can
go back to the pool; a global layer keeps every block. One block table for all layers (one
block = every layer's keys for `block_size` tokens) could free nothing while any layer reads
the whole context, so the layers are split into groups of equal size, each group's layers of
one window, and each group gets its own block table over the one shared pool: a pool block holds
`layers_per_block` layers' keys and values, and layer `i` reads slot `layer_slots[i]` of the
blocks in its group's table. Gemma 3 270M (15 sliding layers, 3 global) is 6 groups of 3: five
tables hold about a window each, one holds the whole context, where one table of 18 layers
would hold the whole context 18 times over. A model whose layers all share one window (Llama:
none) is one group of every layer: one table, as before.

The freed blocks of a table stay in it as `NULL_BLOCK`, so that block `i` still holds tokens
`i * block_size ...`: attention never reads them (each query's window starts after them).

Torch-free: the scheduler counts blocks by it, the model runner lays out its tensors by it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

NULL_BLOCK = -1  # a freed entry of a sliding-window group's table


@dataclass(frozen=True)
class KVGroups:
    group_windows: tuple[int, ...]  # each group's window (0: global, every key)
    layer_groups: tuple[int, ...]  # each layer's group
    layer_slots: tuple[int, ...]  # each layer's slot in a pool block

    @classmethod
    def of(cls, windows: Sequence[int]) -> KVGroups:
        """The layout for layers of these windows (0: global), in layer order."""
        if not windows:
            raise ValueError("a model has at least one layer")
        counts: dict[int, int] = {}
        for w in windows:
            counts[w] = counts.get(w, 0) + 1
        per_block = math.gcd(*counts.values())  # groups of one size, none padded
        group_windows: list[int] = []
        first_group = {}  # window -> its groups' first index, in order of first appearance
        for w, count in counts.items():
            first_group[w] = len(group_windows)
            group_windows.extend([w] * (count // per_block))
        seen = dict.fromkeys(counts, 0)
        layer_groups, layer_slots = [], []
        for w in windows:
            nth = seen[w]
            seen[w] += 1
            layer_groups.append(first_group[w] + nth // per_block)
            layer_slots.append(nth % per_block)
        return cls(tuple(group_windows), tuple(layer_groups), tuple(layer_slots))

    @classmethod
    def uniform(cls, num_layers: int, window: int = 0) -> KVGroups:
        """Every layer of one window: one group."""
        return cls.of([window] * num_layers)

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def num_layers(self) -> int:
        return len(self.layer_groups)

    @property
    def layers_per_block(self) -> int:
        return self.num_layers // self.num_groups


def first_needed_block(window: int, position: int, block_size: int) -> int:
    """A group of this window's first block that a query at `position` or after reads."""
    return max(0, position - window + 1) // block_size if window else 0


def peak_blocks(
    group_windows: Sequence[int], num_tokens: int, chunk_tokens: int, block_size: int
) -> int:
    """Pool blocks a request of `num_tokens` tokens, computed at most `chunk_tokens` a step,
    holds at once over its tables (a sliding group's holds its window and the step's chunk,
    give or take a block at each end)."""
    whole = -(-num_tokens // block_size)
    return sum(
        min(whole, (chunk_tokens + w - 1) // block_size + 2) if w else whole for w in group_windows
    )
