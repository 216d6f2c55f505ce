"""Weights used where they lie: linear layers and the embedding read straight from a GGUF
file's memory map in the type it stores them (the K-quants Q2_K to Q6_K, IQ4_XS, and the floats
F32 / F16 / BF16), with no float copy at any point.

The loader finds, per model module, the file's tensors whose type has a native kernel
(`StoredTensor`, quill/model/gguf_loader.py), swaps those modules for the ones here on the
meta-device model before any storage is given to it, and so never allocates (nor reads) their
floats. A merged projection (q/k/v, gate/up) is stored when every part is: each part keeps its
own type (a Q4_K_M file mixes Q4_K and Q6_K inside one layer). llama.cpp's converter permutes
Llama's q and k rows for its rotary layout; a stored q or k writes each row's output to its
unpermuted column instead (the kernel's `row_map`), so the rows stay where they lie too.

K-quant products are faster in tiles of 16 rows (csrc/kquant_tiles.cpp; with AVX-512, Q4_K
1.0 TOP/s at 64 token rows against 0.37 read row by row, and faster at one row too, 97 against
44 GB/s hot; docs/benchmarks.md), so `pack_tiles` repacks them once at load, the values
unchanged, and lets go of the file's pages they came from: the tiles replace the mapped pages
rather than sit beside them. The AVX2 library's Q6_K tiles lose at a few rows (31 against 48
GB/s at one), so there Q6_K stays where it lies. A table tied to the head is tiled too (the
head is ~a fifth of a 1B model's bytes, and read at every step) and looked up in its tiles. IQ4_XS
tiles win from one row with AVX-512 (60 against 29 GB/s) and from 4 with AVX2 (0.93x at one;
benchmarks/bench_kquant.py). Q2_K and Q3_K (Q2_K / Q3_K_M files) have no tiles: read in place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from quill.ops import kquant, qlinear
from quill.ops.gguf_types import BLOCK32_BYTES, BLOCK32_TYPES, FLOAT_TYPES

log = logging.getLogger(__name__)


@dataclass
class StoredTensor:
    """One tensor of the file as stored: uint8 [rows, bytes per row] (a view of the map), its
    GGML type, and where each row's output goes (None: in order)."""

    data: torch.Tensor
    ggml_type: int
    row_map: torch.Tensor | None = None
    tiles: torch.Tensor | None = None  # the rows repacked (csrc/kquant_tiles.cpp), in HF order

    @property
    def rows(self) -> int:
        return self.data.shape[0]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    @property
    def type_name(self) -> str:
        return _TYPE_NAMES[self.ggml_type]

    @property
    def is_kquant(self) -> bool:
        return self.ggml_type in kquant.NAMES

    @property
    def is_float(self) -> bool:
        return self.ggml_type in FLOAT_DTYPES

    @property
    def values(self) -> torch.Tensor:
        """A float tensor's weights [rows, K] in its own dtype: a view of the same bytes."""
        return self.data.view(FLOAT_DTYPES[self.ggml_type])

    def dequantized(self) -> torch.Tensor:
        """The weights [rows, K] in the file's row order, as fp32 (a float type's: its dtype)."""
        return self.values if self.is_float else kquant.dequantize(self.data, self.ggml_type)


_TYPE_NAMES = {
    **kquant.NAMES,
    **{t: name for name, t in BLOCK32_TYPES.items()},
    **{t: name for name, t in FLOAT_TYPES.items()},
}
FLOAT_DTYPES = {
    FLOAT_TYPES["F32"]: torch.float32,
    FLOAT_TYPES["F16"]: torch.float16,
    FLOAT_TYPES["BF16"]: torch.bfloat16,
}


def float_linear(
    x: torch.Tensor, s: StoredTensor, bias: torch.Tensor | None, native: bool, gemm: bool
) -> torch.Tensor:
    """x @ W.T for a tensor the file stores as floats (F32, F16, BF16), read where it lies:
    natively by quill::dense_linear (it streams the weight once for up to 8 token rows), or,
    with `gemm` (long steps, where `choose_dequantized_products` measured it faster) or
    without the native library, by PyTorch's matrix product over the view, or over chunks
    converted to the activations' dtype."""
    w = s.values
    if native and not gemm:
        out = torch.ops.quill.dense_linear(x, w, None, x.dtype)
    elif w.dtype == x.dtype and w.device == x.device:
        out = F.linear(x, w)
    else:
        step = kquant.dequantized_chunk_rows(x)
        outs = [F.linear(x, w[i : i + step].to(x.device, x.dtype)) for i in range(0, s.rows, step)]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, -1)
    rows = s.row_map if s.row_map is None else s.row_map.to(x.device)
    out = kquant.placed_by(out, rows)
    return out if bias is None else out + bias.to(out.dtype)


class StoredLinear(nn.Module):
    """A linear layer over stored parts (output rows in order); returns the parts' outputs
    as a list when `parts` is given (a merged projection), else one tensor."""

    def __init__(
        self,
        in_features: int,
        segments: list[StoredTensor],
        parts: list[int] | None = None,
        bias: nn.Parameter | None = None,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.segments = segments
        self.parts = parts
        self.out_features = sum(s.rows for s in segments)
        self.bias = bias
        self._fallbacks: list[torch.Tensor | None] = [None] * len(segments)
        # A float copy for steps of more than `max_rows` rows, where it measured faster
        # (`keep_float_copies`); None: every step reads the stored rows.
        self.float_weight: torch.Tensor | None = None
        self.max_rows: int | None = None
        # Steps of more rows than this multiply by the tiles dequantized a chunk at a time
        # (`choose_dequantized_products`, where measured faster: AMX); None: never.
        self.dequantize_above: int | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)

    def floats_only(self, dtype: torch.dtype | None = None) -> bool:
        """Whether every part is stored as floats (of `dtype`, when given): a float copy of
        those in the dtype computed in would be the same values again."""
        return all(s.is_float and dtype in (None, s.values.dtype) for s in self.segments)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The float weight [out_features, in_features] the stored rows stand for."""
        parts = []
        for s in self.segments:
            w = s.dequantized()
            if s.row_map is not None:  # file row i is output row row_map[i]
                placed = torch.empty_like(w)
                placed[s.row_map.long()] = w
                w = placed
            parts.append(w.to(dtype))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        if self.float_weight is not None and x.shape[0] > self.max_rows:
            whole = F.linear(x, self.float_weight, self.bias)
            return whole if self.parts is None else list(whole.split(self.parts, -1))
        outputs, offset = [], 0
        native = kquant.native_available(x)
        dequantize = (
            native and self.dequantize_above is not None and x.shape[0] > self.dequantize_above
        )
        for i, s in enumerate(self.segments):
            bias = None if self.bias is None else self.bias[offset : offset + s.rows]
            if s.is_float:
                outputs.append(float_linear(x, s, bias, native, dequantize))
                offset += s.rows
                continue
            if dequantize:
                if s.tiles is not None:
                    out = kquant.dequantized_linear(x, s.tiles, s.ggml_type, s.rows, bias)
                else:
                    out = kquant.dequantized_rows_linear(x, s.data, s.ggml_type, s.row_map, bias)
                outputs.append(out)
                offset += s.rows
                continue
            fallback = None
            if not native:  # the PyTorch path dequantizes once, and keeps it (GPU, tests)
                if self._fallbacks[i] is None:
                    self._fallbacks[i] = kquant.dequantize(s.data, s.ggml_type).to(x.device)
                fallback = self._fallbacks[i]
            rows = s.row_map if s.row_map is None or native else s.row_map.to(x.device)
            outputs.append(
                kquant.kquant_linear(x, s.data, s.ggml_type, rows, bias, fallback, s.tiles)
            )
            offset += s.rows
        if self.parts is None:
            return outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
        if [s.rows for s in self.segments] == self.parts:
            return outputs
        whole = outputs[0] if len(outputs) == 1 else torch.cat(outputs, -1)
        return list(whole.split(self.parts, -1))

    def extra_repr(self) -> str:
        types = ", ".join(f"{s.type_name} x{s.rows}" for s in self.segments)
        return f"in_features={self.in_features}, rows=[{types}]"


class StoredEmbedding(nn.Module):
    """An embedding table as stored (a K-quant, Q8_0 / Q4_x, or floats): a lookup dequantizes
    (or converts) the rows it reads."""

    def __init__(self, table: StoredTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        per_row = table.data.shape[1]
        if table.is_kquant:
            self.embedding_dim = kquant.in_features(table.data, table.ggml_type)
        elif table.is_float:
            self.embedding_dim = table.values.shape[1]
        else:
            self.embedding_dim = per_row // BLOCK32_BYTES[table.ggml_type] * qlinear.BLOCK

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        if t.is_kquant:
            out = kquant.kquant_rows(t.data, t.ggml_type, ids.cpu(), self.dtype, t.tiles)
        elif t.is_float:
            out = t.values[ids.cpu()].to(self.dtype)
        else:
            flat = ids.cpu().reshape(-1)
            out = qlinear.dequantize_rows(t.data, t.ggml_type, flat, self.dtype)
            out = out.reshape(*ids.shape, -1)
        return out.to(ids.device)


def module_at(model: nn.Module, path: str) -> tuple[nn.Module, str]:
    """(parent, attribute) of the module at a dotted path."""
    parent_path, _, name = path.rpartition(".")
    return (model.get_submodule(parent_path) if parent_path else model), name


def attach_stored(model: nn.Module, stored: dict[str, StoredTensor], config, dtype) -> set[str]:
    """Swap, on the meta-device `model`, every module whose weight rows are all in `stored`
    (Hugging Face name -> StoredTensor) for its stored version. Returns the names taken."""
    from quill.model.registry import family

    target_of = family(config).weight_target
    by_module: dict[str, list[tuple[int, str, StoredTensor]]] = {}
    for name, tensor in stored.items():
        target = target_of(name, config)
        if target is None or not target.param.endswith(".weight"):
            continue
        module = target.param.removesuffix(".weight")
        by_module.setdefault(module, []).append((target.offset, name, tensor))
    taken: set[str] = set()
    for path, pieces in by_module.items():
        pieces.sort(key=lambda piece: piece[0])
        parent, attr = module_at(model, path)
        module = getattr(parent, attr)
        if isinstance(module, nn.Embedding):
            (offset, name, tensor), *_ = pieces
            setattr(parent, attr, StoredEmbedding(tensor, dtype))
            taken.add(name)
            continue
        rows = module.weight.shape[0]
        offsets = [0] + [p[0] + p[2].rows for p in pieces[:-1]]
        if [p[0] for p in pieces] != offsets or pieces[-1][0] + pieces[-1][2].rows != rows:
            continue  # some rows in a type read otherwise: the whole module takes floats
        parts = getattr(module, "parts", None)
        segments = [p[2] for p in pieces]
        setattr(parent, attr, StoredLinear(module.in_features, segments, parts, module.bias))
        taken.update(p[1] for p in pieces)
    embed = getattr(model, "embed_tokens", None)
    if (
        isinstance(embed, StoredEmbedding)
        and (embed.table.is_kquant or embed.table.is_float)
        and getattr(model, "lm_head", 0) is None
    ):
        # Tied: the stored table is the output head as well (a table in blocks of 32 gets an
        # int8 head made from its blocks instead: quill/model/quant.py).
        model.lm_head = StoredLinear(embed.embedding_dim, [embed.table])
    return taken


def tiled_types() -> frozenset[int]:
    """The types repacked in tiles by the library loaded here (the module's docstring)."""
    from quill.ops import library

    native = library.load()
    if native is not None and native.isa == "avx512":
        return kquant.TILE_TYPES
    return kquant.TILE_TYPES - {kquant.Q6_K}


def pack_tiles(model: nn.Module, release=None) -> int:
    """Repack the stored products' parts of `tiled_types()` in tiles (a table tied to the head
    too: its lookups then read the tiles), calling `release(segment)` after each (the file's
    pages it came from can go). Returns the bytes of tiles made."""
    import sys
    import time

    from tqdm import tqdm

    tiled = tiled_types()
    todo = [s for m in model.modules() if isinstance(m, StoredLinear) for s in m.segments
            if s.ggml_type in tiled and s.tiles is None]  # fmt: skip
    total = sum(s.nbytes for s in todo)
    if not todo:
        return 0
    log.info("weights: repacking %.0f MiB of K-quant weights in tiles", total / (1 << 20))
    start, made = time.perf_counter(), 0
    bar = tqdm(total=total, desc="repacking weights", unit="B", unit_scale=True,
               disable=not sys.stderr.isatty(), leave=False)  # fmt: skip
    with bar:
        for s in todo:
            order = None if s.row_map is None else torch.argsort(s.row_map.long())
            s.tiles = torch.ops.quill.kquant_pack(s.data, s.ggml_type, order)
            made += s.tiles.numel()
            if release is not None:
                release(s)
            bar.update(s.nbytes)
    log.info("weights: repacked in %.1f s", time.perf_counter() - start)
    return made
