"""Linear layers the model is built from, so that a quantized version can replace each one.

`Linear` is `nn.Linear` with one addition: up to `native_max_rows` rows (a small step) it
multiplies by quill's native float product (csrc/dense.cpp), which streams the weight as stored
at 2-4x the rate of `F.linear` for a few rows; above that, and off the CPU, `F.linear`. The row
count is measured at start-up (`choose_native_rows`); 0 keeps `F.linear` everywhere.

`MergedLinear` holds several projections of the same input (q/k/v, gate/up) as one weight, so a
checkpoint loads into one parameter and a quantizer sees one matrix, and returns the parts as
separate outputs. Through `F.linear` it applies them part by part or as one product, whichever
measured faster at start-up (`split_products`): row slices of the weight are contiguous views,
and MKL ran two 1536-wide fp32 products ~20% faster than one 3072-wide on AVX2 (a 2000-token
prompt 2.03 s -> 1.54 s), where oneDNN's bf16 ran a layer's merged products 15-30% faster than
its parts at 64 rows on a Zen 4; the native product takes the whole weight at once.
"""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F
from torch import nn

from quill.ops import library

log = logging.getLogger(__name__)

_NATIVE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def dense(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, native_max_rows: int
) -> torch.Tensor:
    """x @ weight.T + bias, natively for up to `native_max_rows` rows on the CPU."""
    if 0 < x.shape[0] <= native_max_rows and x.dim() == 2 and x.device.type == "cpu":
        return torch.ops.quill.dense_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def native_possible(weight: torch.Tensor) -> bool:
    return (
        weight.device.type == "cpu"
        and weight.dtype in _NATIVE_DTYPES
        and weight.stride(-1) == 1
        and library.available()
    )


class Linear(nn.Linear):
    native_max_rows = 0  # rows up to which quill::dense_linear runs (set by choose_native_rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense(x, self.weight, self.bias, self.native_max_rows)


class MergedLinear(Linear):
    split_products = True  # F.linear part by part (else one product; set by choose_split)

    def __init__(self, in_features: int, parts: list[int], bias: bool) -> None:
        super().__init__(in_features, sum(parts), bias)
        self.parts = list(parts)

    def forward(self, x: torch.Tensor) -> list[torch.Tensor]:
        if 0 < x.shape[0] <= self.native_max_rows or not self.split_products:
            y = dense(x, self.weight, self.bias, self.native_max_rows)
            return list(y.split(self.parts, -1))
        outputs, offset = [], 0
        for rows in self.parts:
            bias = None if self.bias is None else self.bias[offset : offset + rows]
            outputs.append(F.linear(x, self.weight[offset : offset + rows], bias))
            offset += rows
        return outputs


def best_time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


ROW_COUNTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


def time_by_rows(
    first: list, second: list, widths: list[int], dtype, stop=None, counts=ROW_COUNTS
) -> list:
    """Two ways of computing one layer's products (callables x -> y, one per input width in
    `widths`) timed over the same random inputs at each of `counts` rows, until
    `stop(t_first, t_second)` holds. Returns [(rows, t_first, t_second)]."""
    results = []
    for rows in counts:
        inputs = [torch.randn(rows, width, dtype=dtype) for width in widths]

        def run(products, inputs=inputs):
            for product, x in zip(products, inputs):
                product(x)

        t_first, t_second = best_time(lambda: run(first)), best_time(lambda: run(second))
        results.append((rows, t_first, t_second))
        if stop is not None and stop(t_first, t_second):
            break
    return results


def float_copy_bytes(modules: list, dtype: torch.dtype, budget: int, what: str) -> int | None:
    """The bytes float copies of `modules` (each with in_ and out_features) take in `dtype`;
    None, and a line in the log, when that passes `budget`."""
    size = torch.tensor([], dtype=dtype).element_size()
    nbytes = sum(m.in_features * m.out_features for m in modules) * size
    if nbytes <= budget:
        return nbytes
    log.info(
        "weights: no float copy of %s for large steps: it would take %.2f GiB, more than the "
        "%.2f GiB allowed",
        what,
        nbytes / (1 << 30),
        budget / (1 << 30),
    )
    return None


def describe_timings(results: list) -> str:
    return ", ".join(f"{rows}: {1e3 * a:.2f}/{1e3 * b:.2f} ms" for rows, a, b in results)


@torch.inference_mode()
def choose_native_rows(model: nn.Module) -> int:
    """Measure one layer's float products natively and through `F.linear` at 1 to 64 rows, here,
    and set every `Linear` of the model (and the model's tied head) to run natively up to the
    largest row count that was faster (contiguous from one row). Returns that count (0: none)."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    layer = [m for m in model.layers[0].modules() if isinstance(m, Linear)]
    if not layer or not all(native_possible(m.weight) for m in linears):
        return 0
    max_rows, timings = 0, []
    for rows in (1, 2, 4, 8, 16, 32, 64):
        inputs = [torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in layer]

        def run(native: bool, inputs=inputs, rows=rows) -> None:
            for m, x in zip(layer, inputs):
                dense(x, m.weight, m.bias, rows if native else 0)

        t_float, t_native = best_time(lambda: run(False)), best_time(lambda: run(True))
        timings.append(f"{rows}: {1e3 * t_float:.2f}/{1e3 * t_native:.2f} ms")
        if t_native >= t_float:
            break
        max_rows = rows
    log.info("float products: one layer F.linear/native by rows %s", ", ".join(timings))
    set_native_rows(model, max_rows)
    return max_rows


@torch.inference_mode()
def choose_split(model: nn.Module, rows: int = 128) -> bool:
    """Measure one layer's merged projections through `F.linear` part by part and as one
    product at `rows` rows (a prompt chunk's or a large batch's step), here, and set every
    `MergedLinear` of the model to the faster. Returns whether parts won."""
    merged = [m for m in model.modules() if isinstance(m, MergedLinear)]
    layer = [m for m in model.layers[0].modules() if isinstance(m, MergedLinear)]
    if not layer:
        return True
    inputs = [torch.randn(rows, m.in_features, dtype=m.weight.dtype) for m in layer]

    def run(split: bool) -> None:
        for m, x in zip(layer, inputs):
            m.split_products, native = split, m.native_max_rows
            m.native_max_rows = 0
            m(x)
            m.native_max_rows = native

    t_split, t_merged = best_time(lambda: run(True)), best_time(lambda: run(False))
    split = t_split < t_merged
    log.info(
        "float products: one layer's merged projections at %d rows in parts %.2f ms, as one "
        "%.2f ms: %s",
        rows,
        1e3 * t_split,
        1e3 * t_merged,
        "parts" if split else "one",
    )
    for m in merged:
        m.split_products = split
    return split


def set_native_rows(model: nn.Module, max_rows: int) -> None:
    """Every `Linear` of the model, and a tied head, native up to `max_rows` rows."""
    for m in model.modules():
        if isinstance(m, Linear):
            m.native_max_rows = max_rows
    model.native_max_rows = max_rows
    forget_native_weights(model)


def forget_native_weights(model: nn.Module) -> None:
    """After the weights or their row counts change: each layer, and the model's stack, looks
    its native weights up anew (quill/model/llama.py caches them)."""
    model.__dict__.pop("_stack_cache", None)
    for layer in model.layers:
        layer.__dict__.pop("_native_cache", None)
