"""The GGUF tensor types quill's native kernels read as a file stores them, and their block
sizes: plain facts, without torch, so the cost model (torch-free) prices them alike.

GGML numbers its types (`gguf.GGMLQuantizationType`); a K-quant (or IQ4_XS) row is a run of
super-blocks of 256 weights (layouts: quill/ops/kquant.py, csrc/kquant.cpp).
"""

from __future__ import annotations

Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS = 10, 11, 12, 13, 14, 23  # GGML's type numbers
NAMES = {Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", IQ4_XS: "IQ4_XS"}
BLOCK_BYTES = {Q2_K: 84, Q3_K: 110, Q4_K: 144, Q5_K: 176, Q6_K: 210, IQ4_XS: 136}
# Where a super-block's fp16 fields (d, and dmin where there are mins) lie, in bytes.
FP16_FIELDS = {Q2_K: (80, 82), Q3_K: (108,), Q4_K: (0, 2), Q5_K: (0, 2), Q6_K: (208,), IQ4_XS: (0,)}
# The types with a tiled kernel (csrc/kquant_tiles.cpp); Q2_K and Q3_K are read in place only.
TILE_TYPES = frozenset({Q4_K, Q5_K, Q6_K, IQ4_XS})
SUPER = 256  # weights per super-block
# The values IQ4_XS's and IQ4_NL's 4-bit codes stand for (ggml's non-linear table).
IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)

# Blocks of 32 weights, an fp16 scale each (Q4_1 and Q5_1 an fp16 minimum too): the types
# whose tensors become quill's int8 / int4 / int5 products (quill/model/quant.py), bytes a
# block. Q5_0's codes less 16 and IQ4_NL's table values are whole numbers within int8: their
# blocks become int8 blocks exactly, with the same scales (no re-quantization); Q5_1's codes
# (0..31) one a byte with their scale and minimum.
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL = 2, 3, 6, 7, 8, 20
BLOCK32_TYPES = {
    "Q4_0": Q4_0, "Q4_1": Q4_1, "Q5_0": Q5_0, "Q5_1": Q5_1, "Q8_0": Q8_0, "IQ4_NL": IQ4_NL,
}  # fmt: skip
BLOCK32_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q5_1: 24, Q8_0: 34, IQ4_NL: 18}
INT8_BLOCK_TYPES = frozenset({"Q8_0", "Q5_0", "IQ4_NL"})  # by name: those that become int8
QUANT_BLOCK_BYTES = {name: BLOCK32_BYTES[t] for name, t in BLOCK32_TYPES.items()}  # by name
# Bytes of a block of 32 as quill's product reads it: codes, fp16 scale, and int4's / int5's fp16
# offset (int8's code sums, 2 bytes more in memory, are read for several rows only).
MADE_BLOCK_BYTES = {"Q8_0": 34, "Q5_0": 34, "IQ4_NL": 34, "Q4_0": 20, "Q4_1": 20, "Q5_1": 36}


# Floats, read where they lie by the float product (quill::dense_linear) or PyTorch's
# (quill/model/stored.py): bytes a weight.
F32, F16, BF16 = 0, 1, 30
FLOAT_TYPES = {"F32": F32, "F16": F16, "BF16": BF16}
FLOAT_BYTES = {F32: 4, F16: 2, BF16: 2}


def type_of(name: str) -> int | None:
    """GGML's number for a type name ("Q4_K"), None for a type read otherwise."""
    return next((t for t, n in NAMES.items() if n == name), None)
