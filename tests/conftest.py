"""Shared fixtures: the default model converted once, one fp32 engine, the reference model.

`--device cuda` runs the tests marked `device` (`pytest -m device --device cuda`) on a GPU: the
engine, the reference model and the tensors those tests make go to that device
(benchmarks/gpu/check.sh). The default, cpu, is the suite as CI runs it.
"""

from __future__ import annotations

import os

import pytest
import torch

torch.set_num_threads(2)

# A stale calibration in this machine's cache (quill/cost/freshness.py) would be refitted,
# a minute each, by every engine the suite starts without --hardware: the suite uses what it
# finds as it is (tests/test_calibration_freshness.py checks the refit itself).
os.environ.setdefault("QUILL_CALIBRATION", "as-is")

# The native library is chosen and loaded once per process; load it before any test points
# QUILL_CACHE at an empty folder (where no library is built).
from quill.ops import library  # noqa: E402

NATIVE = library.load()

# Prompts for reference comparisons: one token up to over a thousand.
_PARAGRAPH = (
    "The history of computing is a story of machines that got smaller, faster and cheaper. "
    "Early computers filled rooms and used vacuum tubes; transistors replaced them, and then "
    "integrated circuits put thousands and later billions of transistors on a single chip. "
)


def long_prompt(num_words: int) -> str:
    words = (_PARAGRAPH * (num_words // 40 + 1)).split()
    return " ".join(words[:num_words])


PROMPTS = [
    "Hello",
    "The capital of France is",
    "def fibonacci(n):",
    "List three colors:\n1.",
    "Once upon a time, in a small village by the sea, there lived",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    long_prompt(300),
    long_prompt(900),
]


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        default="cpu",
        help="where the tests marked `device` run: cpu (default) or cuda",
    )


@pytest.fixture(scope="session")
def device(request) -> torch.device:
    """The device the tests marked `device` run on (--device)."""
    name = request.config.getoption("--device")
    if name == "cuda" and not torch.cuda.is_available():
        pytest.exit("--device cuda: CUDA is not available", returncode=2)
    return torch.device(name)


@pytest.fixture(scope="session")
def model_dir():
    from quill.model.default_model import default_model_dir

    return default_model_dir()


@pytest.fixture(scope="session")
def grammars(model_dir):
    """Grammars for the default model's tokenizer; <|im_end|> (id 2) its end id."""
    from quill.structured.grammar import Grammars

    return Grammars(model_dir / "tokenizer.json", 49152, [2])


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    """The default model's tokenizer.json, as the `tokenizers` library reads it."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="session")
def llm(model_dir, device):
    from quill import LLM

    return LLM(
        str(model_dir),
        device=device.type,
        dtype="float32",
        kv_cache_dtype="float32",  # the exact path; 16-bit caches: tests/test_kv_cache_dtype.py
        quantization="none",
        kv_cache_memory=256 << 20,
        max_num_seqs=64,
    )


@pytest.fixture(scope="session")
def hf_model(model_dir, device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return model.to(device).eval()


def write_tiny_config(directory, model_dir, hidden_size: int = 64) -> None:
    """A 2-layer variant of the default model's config.json, for dummy-weight engines."""
    import json

    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        num_hidden_layers=2,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden_size // 4,
    )
    (directory / "config.json").write_text(json.dumps(config))


def write_random_checkpoint(directory, model_dir, kind: str, heads: int, kv_heads: int) -> str:
    """A random checkpoint of this shape (head dim 16), with the default model's tokenizer."""
    random_checkpoint(directory, kind, hidden_size=heads * 16, intermediate_size=384,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                      sharded=False)  # fmt: skip
    return str(directory)


def random_checkpoint(directory, kind: str, sharded: bool = True, **shape):
    """A tiny randomly initialised transformers model of `kind` (llama, llama3, mistral,
    mistral_window, qwen2, qwen2.5, qwen3, qwen3_moe, phi3, gemma3, gemma3_reference,
    embeddinggemma), saved to `directory` with the default model's tokenizer; returns the
    reference model. `shape` overrides its config."""
    import transformers

    from quill.model.default_model import default_model_dir

    common = dict(
        vocab_size=49152,  # reuse the default tokenizer
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64}  # fmt: skip
    gemma = {"head_dim": 32, "query_pre_attn_scalar": 32, "sliding_window": 8,
             "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True,
             "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                                 "full_attention": {"rope_type": "default",
                                                    "rope_theta": 10000.0}}}  # fmt: skip
    kinds = {  # kind: (config class, model class, what the kind adds)
        "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
        "llama3": ("LlamaConfig", "LlamaForCausalLM",
                   {"rope_theta": 500000.0, "rope_scaling": llama3_rope}),
        "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
        # a sliding window shorter than the prompts and the reply
        "mistral_window": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 24}),
        "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
        # Qwen2.5's small models: Qwen2's layers, tied embeddings
        "qwen2.5": ("Qwen2Config", "Qwen2ForCausalLM", {"tie_word_embeddings": True}),
        # q/k norms, an explicit head dim wider than hidden / heads
        "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 32}),
        # 8 experts, 2 a token; layer 0 dense, layer 1 sparse
        "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                      {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2,
                       "moe_intermediate_size": 32, "norm_topk_prob": True,
                       "mlp_only_layers": [0]}),
        # q/k/v and gate/up fused in the checkpoint
        "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
        # a sliding layer (window of 8) then a global one, each with its RoPE base; head dim
        # 32 runs the native kernel
        "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", gemma),
        # head dim 20: no native kernel takes it, so the PyTorch path (two sets of masks)
        "gemma3_reference": ("Gemma3TextConfig", "Gemma3ForCausalLM",
                             {**gemma, "head_dim": 20, "query_pre_attn_scalar": 20}),
        # EmbeddingGemma's layers: bidirectional attention, no head (Gemma3TextModel)
        "embeddinggemma": ("Gemma3TextConfig", "Gemma3TextModel",
                           {**gemma, "use_bidirectional_attention": True}),
    }  # fmt: skip
    config_class, model_class, extra = kinds[kind]
    config = getattr(transformers, config_class)(**{**common, **extra, **shape})
    torch.manual_seed(0)
    ref = getattr(transformers, model_class)(config).eval()
    with torch.no_grad():  # large random weights, so greedy paths are not all one token
        for p in ref.parameters():
            p.normal_(0, 0.2)
    ref.save_pretrained(str(directory), **({"max_shard_size": "2MB"} if sharded else {}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (directory / name).write_text((default_model_dir() / name).read_text())
    return ref


def run_native_tests_with_avx2(*test_files: str) -> None:
    """Runs the test files' native tests in one process that loads the AVX2 library (an
    AVX-512 CPU runs it too), and fails unless each file's ran and all passed."""
    import os
    import re
    import subprocess
    import sys

    env = {**os.environ, "QUILL_NATIVE_ISA": "avx2"}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", *test_files, "-k",
         "native"],
        env=env,
        capture_output=True,
        text=True,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "skipped" not in proc.stdout.splitlines()[-1], proc.stdout[-3000:]
    for path in test_files:
        name = re.escape(os.path.basename(path))
        assert re.search(rf"{name}::\S+ PASSED", proc.stdout), (path, proc.stdout[-3000:])


def rewrite_gguf(src, dst, encode) -> None:
    """`src`'s metadata and tensors written to `dst` by the `gguf` package's writer, each tensor
    dequantized to float32 and stored as `encode(name, values)` says: (array, raw GGML type, or
    None for the array's own dtype)."""
    import numpy as np
    from gguf import GGUFReader, GGUFValueType, GGUFWriter
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    writer = GGUFWriter(dst, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        if field.types[0] == GGUFValueType.ARRAY:
            writer.add_array(field.name, field.contents())
        else:
            writer.add_key_value(field.name, field.contents(), field.types[0])
    for t in reader.tensors:
        data, raw_dtype = encode(t.name, dequantize(t.data, t.tensor_type).astype(np.float32))
        writer.add_tensor(t.name, data, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_in_fresh_process(path, **options) -> dict:
    """`LLM(path, dtype="float32", kv_cache_memory=8 MiB, **options)` in a fresh interpreter:
    RSS after loading and its peak while loading (VmHWM: `ru_maxrss` carries the forking
    parent's peak across exec), both over the RSS before, and the bytes of the model's float
    parameters."""
    options = {"dtype": "float32", "kv_cache_memory": 8 << 20, **options}
    import json
    import subprocess
    import sys

    script = f"""
import json
from quill import LLM
from quill.ops import library
library.load()
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
before = rss()
llm = LLM({str(path)!r}, **{options!r})
model = llm.engine.runner.model
floats = sum(p.numel() * p.element_size() for p in model.parameters())
peak = int(open('/proc/self/status').read().split('VmHWM:')[1].split()[0]) * 1024
print(json.dumps({{"delta": rss() - before, "peak": peak - before, "floats": floats}}))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
