"""How the KV cache stores its elements: one type for keys and one for values.

`--kv-cache-dtype` names one type for both or `K,V` (keys are the more sensitive half:
docs/benchmarks.md, "The KV cache in 8 bits"). A type is a float one (`float32`, `bfloat16`,
`float16`) or `int8`: codes with an fp16 scale per 32 dimensions of a token's head, kept in
the same (block, KV head) chunk as the codes (csrc/cache_layout.h), so 1 + 2/32 bytes an
element. `auto` stays a 16-bit type (quill.model.loader.resolve_kv_cache_dtype): int8 is asked
for by name. vLLM's fp8 names are refused with the figures: fp8 measured less accurate than
int8 at the same bytes.

Torch-free: the config checks names by it, the cost model prices bytes by it, the runner lays
out its tensors by it.
"""

from __future__ import annotations

from dataclasses import dataclass

SCALE_GROUP = 32  # dimensions of a token's head sharing one int8 scale
ELEMENT_BYTES = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1 + 2 / SCALE_GROUP}
ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "q8_0": "int8"}
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")
# The rule `auto` follows, and the figures behind it (benchmarks/kv_int8_quality.py on the
# default model, 16 chat prompts x 64 tokens, against bf16 KV; docs/benchmarks.md).
AUTO_RULE = (
    "auto keeps keys and values in 16 bits: int8 would hold 1.88x the tokens and read half the "
    "bytes, but on the reference prompts it moved next-token logprobs by 0.013 on average "
    "(bound 0.01) and its free-running greedy continuations agreed on 83% of tokens (bound "
    "95%); int8 values beside 16-bit keys moved them by 0.005 (94%); ask for int8 by name: "
    "--kv-cache-dtype int8, or bfloat16,int8"
)


@dataclass(frozen=True)
class KVCacheFormat:
    key: str  # an ELEMENT_BYTES name
    value: str

    @property
    def name(self) -> str:
        return self.key if self.key == self.value else f"{self.key},{self.value}"

    @property
    def bytes_per_element(self) -> float:
        """Mean bytes of a key or value element (with int8's scales)."""
        return (ELEMENT_BYTES[self.key] + ELEMENT_BYTES[self.value]) / 2

    @property
    def quantized(self) -> bool:
        return "int8" in (self.key, self.value)

    def __str__(self) -> str:
        return self.name


def parse_kv_cache_dtype(name: str) -> tuple[str, str]:
    """`--kv-cache-dtype` -> (keys' type, values' type), each `auto` or a known type; raises
    ValueError naming what is taken."""
    parts = [ALIASES.get(p.strip(), p.strip()) for p in str(name).split(",")]
    for p in parts:
        if p in FP8:
            raise ValueError(
                f"kv_cache_dtype {name!r}: fp8 KV is not offered; measured against bf16 KV it "
                "lost 3-4x int8's accuracy at the same bytes (docs/benchmarks.md), so use int8"
            )
    if len(parts) not in (1, 2) or any(p != "auto" and p not in ELEMENT_BYTES for p in parts):
        raise ValueError(
            f"unknown kv_cache_dtype {name!r} (auto | float32 | bfloat16 | float16 | int8, or "
            "K,V: the keys' and the values' types, e.g. bfloat16,int8)"
        )
    return parts[0], parts[-1]
