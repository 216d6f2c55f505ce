"""Which product serves which step sizes for the weights used where they lie
(quill/model/stored.py), measured at start-up on this machine (or read back from an earlier
start: quill/model/measured.py): the stored products against the same weights dequantized a
chunk at a time into PyTorch's float product, and against float copies kept for long steps.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from quill.model.stored import StoredLinear

log = logging.getLogger(__name__)


def _measured_crossover(kind: str, layer: list, second, dtype: torch.dtype, counts) -> int:
    """One layer's stored products timed against a second way (`second()`: its callables, made
    only if timed) at `counts` rows, or those timings from an earlier start on this machine
    (quill/model/measured.py). Returns the row count above which the second way was faster at
    every count measured (one less than the first count if it never lost; -1: it lost at the
    last)."""
    from quill.model.linear import describe_timings, time_by_rows
    from quill.model.measured import remembered

    what = {
        "dtype": str(dtype),
        "counts": list(counts),
        "products": [
            [s.type_name, s.rows, m.in_features, s.tiles is not None]
            for m in layer
            for s in m.segments
        ],
    }
    widths = [m.in_features for m in layer]
    results = remembered(
        kind, what, lambda: time_by_rows(layer, second(), widths, dtype, counts=counts)
    )
    log.info(
        "weights: one layer's %s by rows %s", kind.replace("-", " "), describe_timings(results)
    )
    lost = [rows for rows, t_stored, t_second in results if t_second >= t_stored]
    if lost and lost[-1] == results[-1][0]:
        return -1
    return lost[-1] if lost else results[0][0] - 1


# Row counts the dequantized products are timed at: below 16 rows the dequantization alone
# (a few Gweights/s) costs more than the tiles' whole product.
DEQUANTIZED_COUNTS = (16, 32, 64, 128, 256, 512)


@torch.inference_mode()
def choose_dequantized_products(model: nn.Module, dtype: torch.dtype) -> int:
    """Time one layer's stored products against the same weights dequantized a chunk at a
    time into PyTorch's float product (kquant.dequantized_linear from the tiles, or
    dequantized_rows_linear from the rows of a type kept where it lies; a float tensor's view,
    or chunks of it converted: `float_linear`), here (or once per machine); where the latter is
    faster from some row count on (AMX's bf16: 2-3x the tiles at 512 rows, more against Q3_K's
    rows), every stored product takes it for steps above that count. Costs no memory beyond a
    chunk. Returns that row count (-1: none)."""
    layer = [m for m in model.layers[0].modules() if isinstance(m, StoredLinear)]
    if not layer:
        return -1

    def dequantized(m):
        def run(x):
            m.dequantize_above = 0
            try:
                return m(x)
            finally:
                m.dequantize_above = None

        return run

    above = _measured_crossover(
        "tiled-dequantized-products",
        layer,
        lambda: [dequantized(m) for m in layer],
        dtype,
        DEQUANTIZED_COUNTS,
    )
    if above < 0:
        return -1
    for m in model.modules():
        if isinstance(m, StoredLinear):
            m.dequantize_above = above
    log.info(
        "weights: steps of more than %d tokens multiply by the tiles dequantized to %s a chunk "
        "at a time, where that measured faster",
        above,
        str(dtype).removeprefix("torch."),
    )
    return above


@torch.inference_mode()
def keep_float_copies(model: nn.Module, dtype: torch.dtype, budget: int) -> tuple[int, int]:
    """Time one layer's stored products against their float copies at 1 to 512 rows, here (or
    once per machine), and where the copies are faster from some row count on (for every larger
    count measured), give every stored product of the layers a float copy for steps above the
    row count before it, if all the copies together take at most `budget` bytes. The tiles run
    narrow products (a 270M model's 640 rows) at a third of their rate on wide ones, where
    bf16's matrix product wins from a few dozen rows. Returns (that max_rows or -1 for none,
    the copies' bytes)."""

    def wanted(m) -> bool:  # a float tensor of the dtype computed in is its own float copy
        return isinstance(m, StoredLinear) and not m.floats_only(dtype)

    stored = [m for layer in model.layers for m in layer.modules() if wanted(m)]
    if not stored:
        return -1, 0
    from quill.model.linear import ROW_COUNTS, float_copy_bytes

    nbytes = float_copy_bytes(stored, dtype, budget, "the stored products")
    if nbytes is None:
        return -1, 0

    layer = [m for m in model.layers[0].modules() if wanted(m)]
    if not layer:
        return -1, 0
    copies = {}  # of the timed layer, kept if chosen

    def floats():
        copies.update({id(m): m.dequantized(dtype) for m in layer})
        return [lambda x, w=copies[id(m)]: F.linear(x, w) for m in layer]

    max_rows = _measured_crossover("stored-float-products", layer, floats, dtype, ROW_COUNTS)
    if max_rows < 0:
        return -1, 0
    for m in stored:
        m.float_weight = copies[id(m)] if id(m) in copies else m.dequantized(dtype)
        m.max_rows = max_rows
    log.info(
        "weights: float copies of the stored products (%.2f GiB) for steps of more than %d "
        "tokens, where they measured faster",
        nbytes / (1 << 30),
        max_rows,
    )
    return max_rows, nbytes
