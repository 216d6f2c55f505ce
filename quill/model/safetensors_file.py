"""A safetensors file's tensors as views of its memory map, so weights already in the dtype the
model computes in are used where they lie (quill/model/loader.py), not copied.

The format: an 8-byte little-endian header length, a JSON header (name -> dtype, shape and
[begin, end) byte offsets into the data after the header; `__metadata__` aside), the data.
`safe_open(...).get_tensor` copies each tensor out of its own map; here a tensor is a torch view
of this one (read-only: a write would fault at once rather than change the file's pages), and
`release_all_but` lets go of the pages of tensors that were copied (merged into q/k/v, converted) or
dropped (quantized without a float copy), which the view's later reads would fault back in.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import numpy as np
import torch

from quill.contract.errors import ModelLoadError

_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise ModelLoadError(f"{str(path)!r} is too short to be a safetensors file")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        (length,) = struct.unpack_from("<Q", self._map, 0)
        if 8 + length > size:
            raise ModelLoadError(f"{str(path)!r}: its header runs past the end of the file")
        try:
            header = json.loads(self._map[8 : 8 + length])
        except ValueError as e:
            raise ModelLoadError(f"{str(path)!r}: unreadable safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self._data = np.frombuffer(self._map, dtype=np.uint8)
        self._start = 8 + length
        self._entries = {}
        for name, entry in header.items():
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                raise ModelLoadError(f"tensor {name!r}: dtype {entry['dtype']} is not read")
            begin, end = (self._start + o for o in entry["data_offsets"])
            count = int(np.prod(entry["shape"], dtype=np.int64))
            if end > size or end - begin != count * dtype.itemsize:
                raise ModelLoadError(f"tensor {name!r} runs past the file or has the wrong size")
            self._entries[name] = (dtype, tuple(entry["shape"]), begin, end)

    def names(self) -> list[str]:
        return list(self._entries)

    def tensor(self, name: str) -> torch.Tensor:
        """The tensor as a view of the map (nothing is read until it is used)."""
        dtype, shape, begin, end = self._entries[name]
        with warnings.catch_warnings():  # the map is read-only, and is only ever read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.from_numpy(self._data[begin:end])
        if dtype.itemsize > 1 and begin % dtype.itemsize:
            raw = raw.clone()  # unaligned for its dtype (no writer makes this): a copy
        return raw.view(dtype).reshape(shape)

    def release_all_but(self, held: set[int]) -> None:
        """Let go of the whole pages this process holds of every tensor whose first byte is not
        at one of the addresses `held` (the model's tensors): a page read again comes back from
        the file."""
        if not hasattr(self._map, "madvise"):
            return
        base, page = self._data.ctypes.data, mmap.PAGESIZE
        for _, _, begin, end in self._entries.values():
            if base + begin in held:
                continue
            first = -(-begin // page) * page  # whole pages only: the neighbours' stay
            last = end // page * page
            if last > first:
                self._map.madvise(mmap.MADV_DONTNEED, first, last - first)
