"""Random-weight models of real shapes, for measuring quill where its users run it.

`write_shape(name, directory)` writes a Hugging Face directory with the real model's
config.json (layers, widths, heads, vocabulary, rope) and a generated tokenizer of exactly
that vocabulary size (a word-level vocabulary "t0".."tN", the model's special tokens at their
real ids, a chat template), so that an engine loads it with `load_format="dummy"` (weights drawn
from the config) and every id the model can sample decodes. No weights are written: the speed
of a step does not depend on their values.

`gguf_files(name, types)` makes GGUF files of the shape the way their users get them: random
bf16 weights in a Hugging Face directory (with the default model's BPE tokenizer, which
llama.cpp's converter knows, padded to the vocabulary size), converted by llama.cpp's own
`convert_hf_to_gguf.py` to bf16 and quantized by its own `llama-quantize` (Q4_K_M, Q6_K, ...).
They are kept under $QUILL_CACHE/peers/models/real/<shape>/ and made once (the build of
benchmarks/peers/build_llama_cpp.sh first). Usage:

    .venv/bin/python benchmarks/real_shapes.py llama-3.1-8b /tmp/llama-8b [--layers 2]
    .venv/bin/python benchmarks/real_shapes.py llama-3.2-1b --gguf Q4_K_M,Q6_K,Q8_0
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_LLAMA3_ROPE = {"rope_type": "llama3", "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}  # fmt: skip
_LLAMA3_SPECIALS = {"bos": 128000, "eos": 128001, "eot": 128009}
_QWEN_SPECIALS = {"bos": None, "eos": 151645, "eot": 151643}

# The published configs' shapes (config.json of each model on the Hugging Face hub).
SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
        intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 32.0},
        max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
        rope_theta=500000.0, rope_scaling={**_LLAMA3_ROPE, "factor": 8.0},
        max_position_embeddings=131072, rms_norm_eps=1e-5, hidden_act="silu",
    ),
    "qwen2.5-3b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=2048,
        intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
        num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, max_position_embeddings=32768, rms_norm_eps=1e-6,
        hidden_act="silu", use_sliding_window=False,
    ),
    "qwen3-4b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=2560,
        intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
        rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
        hidden_act="silu", use_sliding_window=False,
    ),
}  # fmt: skip


def _specials(name: str) -> dict:
    return _LLAMA3_SPECIALS if name.startswith("llama") else _QWEN_SPECIALS


def write_shape(name: str, directory: Path, num_layers: int | None = None) -> Path:
    """`directory` holding `name`'s config (with `num_layers` layers, if given) and a
    generated tokenizer of its vocabulary; returns it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    config = dict(SHAPES[name])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    specials = _specials(name)
    vocab_size = config["vocab_size"]
    config.update(bos_token_id=specials["bos"], eos_token_id=[specials["eos"], specials["eot"]],
                  torch_dtype="bfloat16")  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    names = {specials["eos"]: "<|end_of_text|>", specials["eot"]: "<|eot_id|>"}
    if specials["bos"] is not None:
        names[specials["bos"]] = "<|begin_of_text|>"
    vocab = {names.get(i, f"t{i}"): i for i in range(vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    from tokenizers import AddedToken, decoders

    tokenizer.decoder = decoders.ByteLevel()  # a decoder the grammar library reads
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in names.values()])
    tokenizer.save(str(directory / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|end_of_text|>",
        "bos_token": names.get(specials["bos"]),
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return directory


def _peers() -> Path:
    return Path(os.environ.get("QUILL_CACHE", Path.home() / ".cache" / "quill")) / "peers"


def _random_checkpoint(name: str, directory: Path, num_layers: int | None) -> None:
    """A Hugging Face directory of `name`'s shape: random bf16 weights (std 0.02, norms 1)
    in shards, and the default model's tokenizer files."""
    config = dict(SHAPES[name])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    random_checkpoint(config, directory)


def random_checkpoint(config: dict, directory: Path, std: float = 0.02, seed: int = 0) -> None:
    """A Hugging Face directory of this config's shape: random bf16 weights (normal with this
    std, norms 1) in shards of about 2 GiB, and the default model's tokenizer files (llama.cpp's
    converter knows its BPE; it pads the vocabulary to the config's size)."""
    import torch
    from safetensors.torch import save_file

    from quill.model.default_model import default_model_dir

    config = dict(config)
    # The default tokenizer's own ends: the converter reads them from the tokenizer.
    config.update(bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    directory.mkdir(parents=True, exist_ok=True)
    source = default_model_dir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / f, directory / f)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * std).to(torch.bfloat16)

    def layer(i: int) -> dict:
        p = f"model.layers.{i}."
        out = {
            p + "self_attn.q_proj.weight": rand(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.v_proj.weight": rand(kv * head_dim, hidden),
            p + "self_attn.o_proj.weight": rand(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": rand(inter, hidden),
            p + "mlp.up_proj.weight": rand(inter, hidden),
            p + "mlp.down_proj.weight": rand(hidden, inter),
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
        if config["model_type"] == "qwen2":
            for proj, rows in (("q", heads * head_dim), ("k", kv * head_dim), ("v", kv * head_dim)):
                out[p + f"self_attn.{proj}_proj.bias"] = rand(rows)
        if config["model_type"] == "qwen3":
            out[p + "self_attn.q_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
            out[p + "self_attn.k_norm.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        return out

    weight_map, shard = {}, 0
    tensors = {"model.embed_tokens.weight": rand(vocab, hidden),
               "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16)}  # fmt: skip
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(vocab, hidden)
    for i in range(config["num_hidden_layers"] + 1):
        if sum(t.numel() for t in tensors.values()) > 1 << 30 or i == config["num_hidden_layers"]:
            shard += 1
            file = f"model-{shard:05d}.safetensors"
            save_file(tensors, str(directory / file), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, file))
            tensors = {}
        if i < config["num_hidden_layers"]:
            tensors.update(layer(i))
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def gguf_files(name: str, types: list[str], num_layers: int | None = None) -> dict[str, Path]:
    """`name`'s GGUF files of these llama.cpp types (e.g. "Q4_K_M"), made once and kept."""
    peers = _peers()
    suffix = f"-{num_layers}l" if num_layers else ""
    out_dir = peers / "models" / "real" / f"{name}{suffix}"
    paths = {t: out_dir / f"{name}{suffix}-{t}.gguf" for t in types}
    missing = [t for t, p in paths.items() if not p.is_file()]
    if not missing:
        return paths
    quantize = peers / "bin" / "llama-quantize"
    converter = sorted(peers.glob("src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not quantize.is_file() or not converter:
        raise SystemExit("llama.cpp is not built: bash benchmarks/peers/build_llama_cpp.sh")
    llama_dir = converter[-1].parent
    source = out_dir / f"{name}{suffix}-BF16.gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    if not source.is_file():
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            print(f"real_shapes: random {name} weights -> {tmp}", flush=True)
            _random_checkpoint(name, Path(tmp), num_layers)
            env = {**os.environ, "PYTHONPATH": str(llama_dir / "gguf-py")}
            print(f"real_shapes: llama.cpp's converter -> {source.name}", flush=True)
            subprocess.run(
                [str(peers / "venv" / "bin" / "python"), str(converter[-1]), tmp,
                 "--outtype", "bf16", "--outfile", str(source) + ".tmp"],
                check=True, env=env, stdout=subprocess.DEVNULL,
            )  # fmt: skip
            os.replace(str(source) + ".tmp", source)
    for t in missing:
        if paths[t].is_file():  # BF16: the converter's own output
            continue
        print(f"real_shapes: llama-quantize -> {paths[t].name}", flush=True)
        subprocess.run(
            [str(quantize), str(source), str(paths[t]) + ".tmp", t, str(os.cpu_count() or 1)],
            check=True, stdout=subprocess.DEVNULL,
        )  # fmt: skip
        os.replace(str(paths[t]) + ".tmp", paths[t])
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=Path, nargs="?", default=None)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a smaller run)")
    parser.add_argument("--gguf", default=None, help="llama.cpp types to make: Q4_K_M,Q6_K,...")
    args = parser.parse_args()
    if args.gguf:
        for t, path in gguf_files(args.shape, args.gguf.split(","), args.layers).items():
            print(t, path)
    else:
        print(write_shape(args.shape, args.directory, args.layers))


if __name__ == "__main__":
    main()
