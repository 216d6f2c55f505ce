"""Quill precision variants, precision classes, and the benchmark's random prompts.

bench_engine names quill variants on the command line ("fp32", "bf16+int8", "qauto"); this
turns them into LLM options, and sorts every column (quill, transformers, llama.cpp GGUF types)
into a precision class, so that the report holds each peer against the quill variant that
stores its weights alike.
"""

from __future__ import annotations

import torch

# A variant is '+'-joined parts: a dtype and/or a quantization, e.g. "fp32", "bf16", "int8",
# "bf16+int8" (any part left out is pinned: dtype "auto", quantization "none"); "qauto" asks
# quill to choose the quantization (quantization="auto"). "default" pins nothing.
DTYPES = {
    "auto": "auto",
    "fp32": "float32",
    "float32": "float32",
    "bf16": "bfloat16",
    "bfloat16": "bfloat16",
    "fp16": "float16",
    "float16": "float16",
}
QUANTIZATIONS = {"int8": "int8", "int4": "int4", "qauto": "auto"}
# Precision classes, to pair each peer with the quill variant that stores weights alike.
TORCH_CLASS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
QUANT_CLASS = {"int8": "8bit", "int4": "4bit"}
GGUF_CLASS = {"f32": "f32", "bf16": "bf16", "f16": "f16", "q8_0": "8bit", "q4_0": "4bit"}
GGUF_CLASS["q4_1"] = "4bit"


def prompt_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def parse_variant(text: str) -> dict:
    """'bf16+int8' -> {'dtype': 'bfloat16', 'quantization': 'int8'}; no part: not quantized.
    'default' -> {}: `LLM()` exactly as a user gets it, every option at its default."""
    if text.lower() == "default":
        return {}
    options: dict = {"dtype": "auto", "quantization": "none"}
    for part in text.lower().replace("-", "+").split("+"):
        if part in DTYPES:
            options["dtype"] = DTYPES[part]
        elif part in QUANTIZATIONS:
            options["quantization"] = QUANTIZATIONS[part]
        else:
            raise SystemExit(f"unknown part {part!r} in quill variant {text!r}")
    return options
