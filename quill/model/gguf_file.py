"""A GGUF file's metadata and tensors, read straight from a memory map.

gguf-py's reader decodes every metadata value element by element through numpy views: 2.9 s
for the default model's 49k-token vocabulary and 11 s for Gemma 3's 262k, at every start and
before any weight is read. The format is simple (little-endian: a header, typed key/value
pairs, tensor descriptions, aligned data), so quill reads it here in one pass: numeric arrays
as numpy views, strings decoded once, tensors as views of the map in gguf-py's shapes (so its
`dequantize` and quill's block decoder take them as they are). Without torch, as gguf_config.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from quill.contract.errors import ModelLoadError

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Metadata value types (the GGUF specification's numbering) as struct formats.
_NUMBERS = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
    10: "<Q", 11: "<q", 12: "<d",
}  # fmt: skip
# Tensor types whose data is an array of numbers; every other type is blocks of bytes.
_PLAIN = {
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]  # rows first (the reverse of ggml's ne order), in elements
    data: np.ndarray  # numbers in `shape`, or uint8 blocks: shape[:-1] + (bytes per row,)


class GGUFFile:
    """`fields`: key -> value (str, int, float, bool; a numpy array for numeric arrays, a list
    for arrays of strings or of arrays); `tensors` in the file's order. The memory map stays
    open while any tensor's data is referenced."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size < 24:  # magic, version and the two counts
                raise ModelLoadError(f"{str(path)!r} is too short to be a GGUF file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._map[:4] != _MAGIC:
            raise ModelLoadError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        self._pos = len(_MAGIC)
        version = self._number(4)
        if version not in (2, 3):
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            why = "big-endian GGUF files are not read" if swapped in (2, 3) else "unknown version"
            raise ModelLoadError(f"{str(path)!r}: GGUF version {version}: {why}")
        num_tensors, num_fields = self._number(10), self._number(10)
        self.fields: dict[str, object] = {}
        for _ in range(num_fields):
            key = self._string()
            self.fields[key] = self._value(self._number(4))
        infos = []
        for _ in range(num_tensors):
            name = self._string()
            dims = [self._number(10) for _ in range(self._number(4))]
            infos.append((name, GGMLQuantizationType(self._number(4)), dims, self._number(10)))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-self._pos // alignment) * alignment
        data = np.frombuffer(self._map, dtype=np.uint8)
        self.tensors = [self._tensor(data, start, *info) for info in infos]

    def _tensor(self, data: np.ndarray, start: int, name, kind, dims, offset) -> GGUFTensor:
        shape = tuple(reversed(dims)) or (1,)
        count = int(np.prod(shape))
        block, size = GGML_QUANT_SIZES[kind]
        begin = start + offset
        end = begin + count // block * size
        if end > len(data) or count % block:
            raise ModelLoadError(f"tensor {name!r} ({kind.name} {list(shape)}) runs past the file")
        raw = data[begin:end]
        if kind in _PLAIN:
            return GGUFTensor(name, kind, shape, raw.view(_PLAIN[kind]).reshape(shape))
        return GGUFTensor(name, kind, shape, raw.reshape(*shape[:-1], shape[-1] // block * size))

    def release(self, data: np.ndarray) -> None:
        """Let go of the pages of a tensor's data (a view of the map) that this process holds:
        it was copied elsewhere (quill/model/stored.py's tiles). The view stays valid: a page
        read again comes back from the file."""
        base = np.frombuffer(self._map, dtype=np.uint8).ctypes.data
        begin = data.ctypes.data - base
        page = mmap.PAGESIZE
        first = -(-begin // page) * page  # whole pages only: the neighbours' stay
        last = (begin + data.nbytes) // page * page
        if last > first and hasattr(self._map, "madvise"):
            self._map.madvise(mmap.MADV_DONTNEED, first, last - first)

    def _number(self, code: int):
        fmt = _NUMBERS[code]
        (value,) = struct.unpack_from(fmt, self._map, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        (length,) = struct.unpack_from("<Q", self._map, self._pos)
        begin = self._pos + 8
        self._pos = begin + length
        if self._pos > len(self._map):
            raise ModelLoadError("a GGUF string runs past the end of the file")
        return self._map[begin : self._pos].decode("utf-8", errors="replace")

    def _value(self, code: int):
        if code == _STRING:
            return self._string()
        if code == _ARRAY:
            kind, count = self._number(4), self._number(10)
            if kind in (_STRING, _ARRAY):
                return [self._value(kind) for _ in range(count)]
            if kind not in _NUMBERS:
                raise ModelLoadError(f"GGUF array of value type {kind} is not read")
            dtype = np.dtype(_NUMBERS[kind])
            values = np.frombuffer(self._map, dtype, count, self._pos)
            self._pos += count * dtype.itemsize
            return values
        if code not in _NUMBERS:
            raise ModelLoadError(f"GGUF metadata value type {code} is not read")
        return self._number(code)
