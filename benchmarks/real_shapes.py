"""Random-weight models of real shapes, for measuring quill where its users run it.

`write_shape(name, directory)` writes a Hugging Face directory with the real model's
config.json (layers, widths, heads, vocabulary, rope) and a generated tokenizer of exactly
that vocabulary size (a word-level vocabulary "t0".."tN", the model's special tokens at their
real ids, a chat template), so that an engine loads it with `load_format="dummy"` (weights drawn
from the config) and every id the model can sample decodes. No weights are written: the speed
of a step does not depend on their values. Usage:

    .venv/bin/python benchmarks/real_shapes.py llama-3.1-8b /tmp/llama-8b [--layers 2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("directory", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a smaller run)")
    args = parser.parse_args()
    print(write_shape(args.shape, args.directory, args.layers))


if __name__ == "__main__":
    main()
