"""Weight-only quantization by swapping the model's linear modules (the model code is untouched).

A decode step at a small batch reads every weight once for a handful of rows, so its time is the
weights' bytes: int8 reads a quarter of fp32's, int4 an eighth. At large batches the step is
arithmetic, and there the float weights win; a module can keep them and use them above
`max_rows` rows ("a quantized copy for small batches").

- int8: GGUF's Q8_0, one fp16 scale per row and block of 32 inputs, multiplied by quill's native
  kernel (csrc/qlinear.cpp: activations quantized to int8 per block, integer dot products).
  Without the native library (or on a GPU) the module multiplies by the dequantized weight,
  correct but no faster than float.
- int4: GGUF's Q4_1 (per block of 32 inputs a scale and a minimum, so the default model's own
  4-bit weights come back nearly exactly), by the native 4-bit kernel (csrc/qlinear.cpp).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from quill.model.linear import (
    describe_timings,
    float_copy_bytes,
    forget_native_weights,
    time_by_rows,
)
from quill.ops import library, qlinear
from quill.ops.gguf_types import INT8_BLOCK_TYPES

log = logging.getLogger(__name__)

INT4_GROUP = qlinear.BLOCK


class QuantizedLinear(nn.Module):
    """Replaces an `nn.Linear` (or `MergedLinear`, whose parts it returns the same way)."""

    def __init__(
        self,
        linear: nn.Linear,
        method: str,
        max_rows: int | None = None,
        stored: tuple[torch.Tensor, ...]
        | qlinear.PackedQ8
        | qlinear.PackedQ4
        | qlinear.PackedQ5
        | None = None,
        unloaded: bool = False,
    ) -> None:
        """stored: the blocks to take as they are (a GGUF file's): (codes, scales) for int8,
        (codes, d, c) for int4 and int5 (Q5_1), or those already packed. `unloaded`: the
        linear's float weight was never filled (the blocks are all there is); no float copy is
        kept."""
        super().__init__()
        if unloaded and (stored is None or max_rows is not None):
            raise ValueError("a weight loaded only as blocks needs its blocks and no float copy")
        # Its shape and device only, when unloaded: reading it would fault in untouched pages.
        weight = linear.weight.detach() if unloaded else linear.weight.detach().float()
        self.method = method
        self.parts = getattr(linear, "parts", None)
        self.out_features, self.in_features = weight.shape
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        # Rows above which the float weight is faster (None: always quantized, float dropped).
        self.max_rows = max_rows
        self.float_weight = linear.weight.detach() if max_rows is not None else None
        # The dequantized weight, made on first use where the native kernel cannot run.
        self._fallback: torch.Tensor | None = None
        # A weight loaded only as blocks may have no storage at all (a head tied to a table
        # looked up where it lies is built on the meta device): its blocks say where it is.
        device = torch.device("cpu") if weight.device.type == "meta" else weight.device
        self.native = device.type == "cpu" and library.load() is not None
        if method == "int8":
            blocks = qlinear.quantize_q8_0(weight) if stored is None else stored
            self.q8 = _packed(blocks, qlinear.PackedQ8, qlinear.pack, device)
        elif method == "int4":
            if self.in_features % INT4_GROUP:
                raise ValueError(f"int4 needs in_features divisible by {INT4_GROUP}")
            blocks = qlinear.quantize_q4_1(weight) if stored is None else stored
            self.q4 = _packed(blocks, qlinear.PackedQ4, qlinear.pack_q4, device)
        elif method == "int5":  # a GGUF file's Q5_1 blocks (never made from floats)
            if stored is None:
                raise ValueError("int5 weights are a GGUF file's Q5_1 blocks; there are none")
            self.q5 = _packed(stored, qlinear.PackedQ5, qlinear.pack_q5, device)
        else:
            raise ValueError(f"unknown quantization {method!r}")

    @property
    def packed(self) -> qlinear.PackedQ8 | qlinear.PackedQ4 | qlinear.PackedQ5:
        return getattr(self, {"int8": "q8", "int4": "q4", "int5": "q5"}[self.method])

    def dequantized(self) -> torch.Tensor:
        """The float weight the quantized one stands for (fp32)."""
        return self.packed.dequantized()

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        y = self._product(x)
        return y if self.parts is None else list(y.split(self.parts, dim=-1))

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        if self.max_rows is not None and x.shape[0] > self.max_rows:
            return F.linear(x, self.float_weight, self.bias)
        if self.method == "int8" and self.native and x.dim() == 2:
            return qlinear.native_q8_linear(x, self.q8, self.bias)
        if self.method == "int4" and self.native and x.dim() == 2:
            return qlinear.native_q4_linear(x, self.q4, self.bias)
        if self.method == "int5" and self.native and x.dim() == 2:
            return qlinear.native_q5_linear(x, self.q5, self.bias)
        if self._fallback is None or self._fallback.dtype != x.dtype:
            self._fallback = self.dequantized().to(x.device, x.dtype)
        return F.linear(x, self._fallback, self.bias)


def _packed(blocks, kind: type, pack, device: torch.device):
    """`blocks` packed (already, or now) for the kernel, on `device`."""
    if isinstance(blocks, kind):
        return blocks
    return pack(*(t.to(device) for t in blocks))


def pack_blocks(kind: str, tensors: tuple[torch.Tensor, ...]):
    """A GGUF file's decoded blocks of 32 (quill/model/gguf_loader.py) in the layout of the
    product they become: int8 for Q8_0, Q5_0 and IQ4_NL, int4 for Q4_0 and Q4_1, int5 for Q5_1."""
    pack = {"int8": qlinear.pack, "int4": qlinear.pack_q4, "int5": qlinear.pack_q5}
    return pack[_METHOD_OF[kind]](*tensors)


def _linears(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    return [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]


# The GGUF types each method takes as stored (Q5_0 and IQ4_NL blocks are int8 blocks exactly).
_STORED_TYPES = {"int8": tuple(INT8_BLOCK_TYPES), "int4": ("Q4_0", "Q4_1"), "int5": ("Q5_1",)}
_METHOD_OF = {kind: method for method, kinds in _STORED_TYPES.items() for kind in kinds}


def quantize_model(
    model: nn.Module,
    method: str,
    max_rows: int | None = None,
    head: bool = False,
    blocks: dict[str, tuple[str, tuple[torch.Tensor, ...]]] | None = None,
    unloaded: frozenset[str] = frozenset(),
) -> dict[str, str]:
    """Swap the decoder layers' linear modules for quantized ones, in place; with `head`, the
    output head too, in int8 (for a tied model, a quantized copy of the embedding table, which
    the embedding lookup keeps using in float). `blocks`: parameter name -> (GGUF type, blocks)
    loaded from a GGUF file; those of a type the method stores alike are taken as they are.
    Those in `unloaded` (no floats loaded) become their blocks' own method whatever `method`
    is (None: only those). Returns the parameters so taken, with their types."""
    taken: dict[str, str] = {}

    def make(linear: nn.Linear, name: str, method: str | None) -> nn.Module:
        if name in unloaded:
            kind, tensors = blocks.pop(name)  # packed now: the decoded blocks can go
            taken[name] = kind
            return QuantizedLinear(linear, _METHOD_OF[kind], None, tensors, unloaded=True)
        if method is None:
            return linear
        return QuantizedLinear(linear, method, max_rows, stored(name, method))

    def stored(name: str, method: str) -> tuple[torch.Tensor, ...] | None:
        kind, tensors = (blocks or {}).get(name, (None, None))
        if kind not in _STORED_TYPES.get(method, ()):
            return None
        taken[name] = kind
        return tensors

    for i, layer in enumerate(model.layers):
        for parent, name, linear in _linears(layer):
            setattr(parent, name, make(linear, f"layers.{i}.{name}.weight", method))
    embed = model.embed_tokens
    if "lm_head.weight" in unloaded:
        model.lm_head = make(model.lm_head, "lm_head.weight", None)
    elif model.lm_head is None and not isinstance(embed, nn.Embedding):
        # Tied to a table looked up where it lies (quill/model/stored.py) in blocks of 32: the
        # head is made from its blocks alone, whatever `head` and `method` say.
        linear = nn.Linear(embed.embedding_dim, embed.table.rows, bias=False, device="meta")
        model.lm_head = make(linear, "embed_tokens.weight", None)
    elif head and isinstance(model.lm_head, nn.Linear | None):  # not a stored head
        linear, name = model.lm_head, "lm_head.weight"
        if linear is None:
            table = embed.weight
            linear = nn.Linear(table.shape[1], table.shape[0], bias=False, device="meta")
            linear.weight = table
            name = "embed_tokens.weight"
        # The head in int8 for either method, as GGUF's Q4 files keep it in Q8_0: it is a fifth
        # of the default model's bytes, and its logits decide every greedy choice. With no
        # method (only the blocks-alone weights), where the file has it in Q8_0.
        if method is not None or (blocks or {}).get(name, ("",))[0] == "Q8_0":
            rows = max_rows if method is not None else None
            model.lm_head = QuantizedLinear(linear, "int8", rows, stored(name, "int8"))
    forget_native_weights(model)
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    qlinear.move_to_huge_pages([m.packed for m in quantized])
    return taken


@torch.inference_mode()
def keep_block_float_copies(
    model: nn.Module, max_rows: int, dtype: torch.dtype, budget: int
) -> int:
    """Give the layers' products made from a GGUF file's blocks alone (no floats loaded: Q8_0,
    Q5_0, IQ4_NL, Q4_x) a float copy of their blocks' values for steps above `max_rows`, the
    row count above which one layer's float products measured faster than int8
    (`choose_quantization`), if the copies together take at most `budget` bytes: as a float
    tensor of the file gets (Gemma 3 270M's Q5_0 products, int8 only, took its 512-token prompt
    from 0.17 to 0.23 s on AMX). The head is left out: a prompt's step scores a few rows.
    Returns the copies' bytes (0: none kept)."""
    made = [m for layer in model.layers for m in layer.modules()
            if isinstance(m, QuantizedLinear) and m.float_weight is None]  # fmt: skip
    nbytes = float_copy_bytes(made, dtype, budget, "the products made from blocks")
    if not made or nbytes is None:
        return 0
    for m in made:
        m.float_weight = m.dequantized()[:, : m.in_features].to(dtype)
        m.max_rows = max_rows
    log.info(
        "weights: float copies of the %d products made from blocks (%.2f GiB) for steps of more "
        "than %d tokens, as the float products measured faster there",
        len(made),
        nbytes / (1 << 30),
        max_rows,
    )
    return nbytes


@torch.inference_mode()
def choose_quantization(model: nn.Module, device: torch.device) -> tuple[str, int | None]:
    """`auto`: measure one layer's projections in float and in int8 at 1 to 512 rows, here.

    Returns ("int8", max_rows) with the largest row count up to which int8 was faster
    (contiguous from one row), or ("none", None) when int8 is not faster even for one row.
    """
    if device.type != "cpu":
        return "none", None
    layer_linears = [lin for _, _, lin in _linears(model.layers[0])]
    if not layer_linears:  # the layers' products are used as a GGUF file stores them
        return "none", None
    quantized = [QuantizedLinear(lin, "int8") for lin in layer_linears]
    dtype = layer_linears[0].weight.dtype
    widths = [lin.in_features for lin in layer_linears]
    results = time_by_rows(layer_linears, quantized, widths, dtype, lambda f, q: q >= f)
    faster = [rows for rows, t_float, t_int8 in results if t_int8 < t_float]
    max_rows = faster[-1] if faster else None
    log.info("quantization auto: one layer float/int8 by rows %s", describe_timings(results))
    if max_rows is None:
        return "none", None
    return "int8", max_rows
