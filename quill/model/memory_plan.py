"""Memory that follows the model: what its weights will take, checked against the machine
before anything is loaded, and the KV pool sized from what is left after them.

The weights' bytes are worked out from the file before reading it: a GGUF tensor used where
it lies (quill/model/stored.py) costs its bytes in the file (its pages, once read), one loaded
as floats its elements times the dtype's size, and on a CPU the quantized copy `auto` may add
beside a float weight (int8: 34 bytes a block of 32). A model whose weights, the working
memory of a step and the KV of one sequence of a minimal context do not fit what the machine
has available is refused with the figures, before loading, never killed halfway by the kernel.

Without `kv_cache_memory`, a CPU's KV pool is a share of what is left after the weights (up to
`KV_CAP`); where that holds less than the model's context, `max_model_len` is clamped to what
it holds, and the log says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quill.contract.errors import ModelLoadError
from quill.ops.gguf_types import MADE_BLOCK_BYTES

GIB = 1 << 30
KV_SHARE = 0.5  # of what is left after the weights and the working memory
KV_CAP = 4 * GIB  # the most a CPU's pool takes unless kv_cache_memory says otherwise
MIN_CONTEXT = 2048  # the least context a loaded model must be able to hold (or its own, if less)
INT8_BYTES = MADE_BLOCK_BYTES["Q8_0"] / 32  # a weight's bytes in quill's int8 copy
# `auto` keeps a float copy beside the int8 one (for large steps, where it is faster) only while
# both together take at most this share of the memory available.
COPIES_SHARE = 0.5
# A float copy beside the products used as a GGUF file stores them (for large steps, where it
# measured faster: quill/model/stored.py) only while it takes at most this share of the memory
# available: a 270M model's 71 MB, never a 1B model's 2.4 GB (whose tiles are the faster).
STORED_COPY_SHARE = 1 / 16


@dataclass
class MemoryPlan:
    available: int  # bytes the machine has available before the model is loaded
    weights: int  # bytes the weights will take
    working: int  # a step's activations, the runtime, the tokenizer: kept free
    parts: dict[str, int]  # the weights by how they are held, for the messages

    @property
    def left(self) -> int:
        """Bytes left for the KV pool once the weights are in and the working memory is kept."""
        return max(0, self.available - self.weights - self.working)

    def copies_fit(self) -> bool:
        """Whether float and int8 copies of the weights may both be kept."""
        return self.parts["floats"] + self.parts["int8 copies"] <= COPIES_SHARE * self.available

    def kv_budget(self) -> int:
        """The CPU's default pool: a share of what is left, at most KV_CAP."""
        return min(int(self.left * KV_SHARE), KV_CAP)

    def describe(self) -> str:
        held = ", ".join(
            f"{what} {size / GIB:.2f} GiB" for what, size in self.parts.items() if size
        )
        return f"weights {self.weights / GIB:.2f} GiB ({held})"

    def check(self, model_name: str, min_kv_bytes: int, min_tokens: int) -> None:
        """Refuse, with the figures, a model that cannot be loaded and hold `min_tokens` of KV."""
        needed = self.weights + self.working + min_kv_bytes
        if needed > self.available:
            raise ModelLoadError(
                f"{model_name} needs {needed / GIB:.2f} GiB: {self.describe()}, "
                f"{self.working / GIB:.2f} GiB working memory, {min_kv_bytes / GIB:.2f} GiB of "
                f"KV for {min_tokens} tokens; {self.available / GIB:.2f} GiB are available. "
                "A smaller quantization (a Q4_K_M GGUF file, quantization=int4) or "
                "max_model_len would need less."
            )


def available_memory(device) -> int:
    if device.type == "cuda":
        import torch

        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return host_available_memory()


def host_available_memory() -> int:
    """The host's memory available now (MemAvailable; 8 GiB where /proc does not say)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 * GIB


def plan_memory(
    model_path: Path,
    load_format: str,
    num_params: int,
    dtype_bytes: int,
    device,
    keep_stored: bool,
    quantization: str,
) -> MemoryPlan:
    """The plan for loading `model_path` (`num_params`: the config's count, for a file whose
    tensors are not listed, or dummy weights)."""
    available = available_memory(device)
    parts = {"used as stored": 0, "repacked": 0, "floats": 0, "int8 copies": 0}
    copies = device.type == "cpu" and quantization in ("auto", "int8")
    gguf = model_path.is_file() and load_format != "dummy"
    if gguf:
        from quill.model.gguf_file import GGUFFile
        from quill.ops import gguf_types
        from quill.ops.gguf_types import QUANT_BLOCK_BYTES

        in_place = keep_stored and device.type == "cpu"
        stored_types = {*gguf_types.NAMES.values(), *gguf_types.FLOAT_TYPES} if in_place else set()
        tensors = GGUFFile(model_path).tensors
        tied = not any(t.name == "output.weight" for t in tensors)
        for t in tensors:
            numel = 1
            for n in t.shape:
                numel *= n
            if t.tensor_type.name in stored_types and len(t.shape) == 2:
                parts["used as stored"] += t.data.nbytes
                continue
            # Blocks of 32: int8 / int4 / int5 weights made from the blocks alone (Q5_0 /
            # IQ4_NL's become int8); the embedding table is looked up where it lies (a tied
            # head made from its blocks).
            if in_place and t.tensor_type.name in QUANT_BLOCK_BYTES and len(t.shape) == 2:
                made = numel * MADE_BLOCK_BYTES[t.tensor_type.name] / 32
                if t.name == "token_embd.weight":
                    parts["used as stored"] += t.data.nbytes
                    parts["int8 copies"] += int(made) if tied else 0
                else:
                    parts["repacked"] += int(made)
                continue
            parts["floats"] += numel * dtype_bytes
            if copies and len(t.shape) == 2:
                parts["int8 copies"] += int(numel * INT8_BYTES)
    else:
        parts["floats"] = num_params * dtype_bytes
        if copies:
            parts["int8 copies"] = int(num_params * INT8_BYTES)
    weights = sum(parts.values())
    working = GIB // 2 + weights // 20
    return MemoryPlan(available, weights, working, parts)
