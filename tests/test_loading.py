"""Loading paths: GGUF, tiny random Llama-3 / Qwen2 / Mistral checkpoints, shards, dummy weights."""

from __future__ import annotations

import pytest
import torch

from quill import LLM, SamplingParams
from quill.model.config import ModelConfig
from quill.model.layers import rope_inv_freq
from tests.conftest import load_in_fresh_process, random_checkpoint, write_tiny_config


def test_gguf_weights_match_transformers_gguf_loader():
    """Our GGUF reading (dequantize + undoing llama.cpp's q/k row order) against transformers'."""
    from transformers import AutoModelForCausalLM

    from quill.model import gguf_loader
    from quill.model.default_model import default_gguf_path

    path = default_gguf_path()
    reader = gguf_loader.open_gguf(path)
    config = gguf_loader.gguf_hf_config(reader)
    ours = dict(gguf_loader.gguf_tensors(reader, config))
    ref = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).state_dict()
    names = [n for n in ref if n != "lm_head.weight"]  # tied to the embedding
    assert set(names) == set(ours)
    for name in names:
        assert torch.equal(ours[name], ref[name].float()), name


@pytest.mark.parametrize(
    "kind",
    [
        "llama3",
        "qwen2",
        "qwen2.5",
        "qwen3",
        "qwen3_moe",
        "phi3",
        "mistral",
        "mistral_window",
        "gemma3",
        "gemma3_reference",
        "head_dim_48",
    ],  # fmt: skip
)
@pytest.mark.device
def test_tiny_random_checkpoints_match_transformers(tmp_path, kind, device):
    ref = _tiny_checkpoint(tmp_path, kind).to(device)
    llm = LLM(
        str(tmp_path),
        device=device.type,
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_memory=16 << 20,
    )
    prompts = [[5, 17, 300, 4000], list(range(100, 190))]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs, strict=True):
        t = torch.tensor([ids], device=device)
        with torch.inference_mode():
            expected = ref.generate(
                t,
                attention_mask=torch.ones_like(t),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            first = ref(t).logits[0, -1].log_softmax(-1)
        assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist(), kind
        # The first token's distribution too: a random model's greedy path can hide a wrong
        # layer behind a token that wins anyway.
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert logprob == pytest.approx(first[token].item(), abs=1e-3), (kind, token)


@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe", "phi3", "gemma3"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_every_family_runs_quantized(tmp_path, kind, quantization):
    """Each family's products in int8 and 4-bit, the experts' too: every linear module of the
    layers is swapped, and the float model's next token stays among the quantized model's five
    likeliest, prompt after prompt."""
    from quill.model.quant import QuantizedLinear

    _tiny_checkpoint(tmp_path, kind)
    prompts = [[5, 17, 300, 4000], list(range(100, 190)), [7] * 40]
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    runs = {}
    for q in ("none", quantization):
        llm = LLM(str(tmp_path), dtype="float32", quantization=q, kv_cache_memory=16 << 20)
        runs[q] = llm.generate(prompts, params, use_tqdm=False)
        if q != "none":
            modules = list(llm.engine.runner.model.layers.modules())
            assert not [m for m in modules if isinstance(m, torch.nn.Linear)]
            assert sum(isinstance(m, QuantizedLinear) for m in modules) >= 4
            for layer in llm.engine.runner.model.layers:
                if getattr(layer, "sparse", False):  # every expert's two products
                    experts = [*layer.experts.gate_up, *layer.experts.down]
                    assert all(isinstance(m, QuantizedLinear) for m in experts)
                    assert len(experts) == 2 * 8
        llm.close()
    for exact, quantized in zip(runs["none"], runs[quantization], strict=True):
        assert exact.outputs[0].token_ids[0] in quantized.outputs[0].logprobs[0]


def _mapped_files(pointer: int) -> set[str]:
    """The files this process maps at `pointer` (from /proc/self/maps)."""
    found = set()
    for line in open("/proc/self/maps"):
        fields = line.split()
        begin, end = (int(x, 16) for x in fields[0].split("-"))
        if begin <= pointer < end and len(fields) >= 6:
            found.add(fields[5])
    return found


def test_safetensors_weights_in_the_dtype_computed_in_are_used_where_they_lie(
    tmp_path, monkeypatch
):
    """A checkpoint in the dtype computed in: each weight that is a whole parameter (o, down,
    the embedding, the head) is a view of the file's map; q/k/v and gate/up, merged into one
    product each, are copies; the model serves the same tokens as one whose weights were all
    copied (the float32 checkpoints of the tests above run the same path against
    transformers)."""
    import quill.model.loader as loader

    _tiny_checkpoint(tmp_path, "llama")
    options = dict(dtype="float32", kv_cache_dtype="float32", quantization="none",
                   kv_cache_memory=16 << 20)  # fmt: skip
    mapped = LLM(str(tmp_path), **options)
    model = mapped.engine.runner.model
    shards = {str(p) for p in tmp_path.glob("*.safetensors")}
    for param in ("layers.0.o_proj.weight", "layers.1.down_proj.weight",
                  "embed_tokens.weight", "lm_head.weight"):  # fmt: skip
        tensor = model.get_parameter(param)
        assert _mapped_files(tensor.data_ptr()) & shards, param
    for param in ("layers.0.qkv_proj.weight", "layers.0.gate_up_proj.weight"):
        assert not _mapped_files(model.get_parameter(param).data_ptr()) & shards, param
    prompts = [[5, 17, 300, 4000], list(range(100, 190))]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    got = mapped.generate(prompts, params, use_tqdm=False)
    mapped.close()

    load_weights = loader.load_weights

    def copied(*args, **kwargs):  # every weight copied, as before
        return load_weights(*args, **{**kwargs, "in_place": False})

    monkeypatch.setattr(loader, "load_weights", copied)
    copy = LLM(str(tmp_path), **options)
    assert not _mapped_files(copy.engine.runner.model.layers[0].o_proj.weight.data_ptr()) & shards
    want = copy.generate(prompts, params, use_tqdm=False)
    for a, b in zip(got, want, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_a_bf16_safetensors_model_loads_in_about_its_own_size():
    """The default model's bf16 safetensors computed in bf16 without quantization, in a fresh
    process: RSS after loading and at its peak within the file's size and 300 MB (the engine's
    working buffers, as the GGUF files' tests): the weights that are views of the map are not
    copied, and the merged ones' pages of the file are let go once copied."""
    from quill.model.default_model import default_model_dir

    directory = default_model_dir()
    size = (directory / "model.safetensors").stat().st_size
    figures = load_in_fresh_process(directory, dtype="bfloat16", quantization="none")
    allowed = size + (8 << 20) + (300 << 20)
    assert figures["delta"] <= allowed and figures["peak"] <= allowed, (figures, allowed)


def _tiny_checkpoint(tmp_path, kind: str):
    """`kind`'s tiny random checkpoint, sharded; head_dim_48: rotary half-rows of 24, not the
    native layer's 16-lane multiple, so the op path."""
    if kind == "head_dim_48":
        ref = random_checkpoint(tmp_path, "llama", head_dim=48)
    else:
        ref = random_checkpoint(tmp_path, kind)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    return ref


def test_a_head_dim_the_fused_native_layer_cannot_take_runs_on_the_op_path(tmp_path, model_dir):
    """head_dim 48: rotary half-rows of 24 lanes, which quill::decoder_stack's rope cannot
    take (16-lane multiples); int8 weights would otherwise qualify every layer for it."""
    import json

    from quill.model.default_model import default_model_dir

    config = json.loads((model_dir / "config.json").read_text())
    config.update(num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=6, head_dim=48)
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        tokenizer=str(default_model_dir()),
        quantization="int8",
        kv_cache_memory=16 << 20,
    )
    assert llm.engine.worker.runner.model.layers[0]._native_weights() is None
    out = llm.generate([[5, 17, 300]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


def test_llama3_rope_frequencies_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    hf = LlamaConfig(
        hidden_size=4096,
        num_attention_heads=32,
        rope_theta=500000.0,
        max_position_embeddings=131072,
        rope_scaling=scaling,
    )
    ref, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    ours = rope_inv_freq(
        ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    )
    assert torch.allclose(ours, ref.float(), rtol=1e-6)


def test_dummy_weights_from_config_alone(tmp_path, model_dir):
    write_tiny_config(tmp_path, model_dir, hidden_size=128)
    llm = LLM(
        str(tmp_path),
        load_format="dummy",
        dtype="float32",
        kv_cache_memory=8 << 20,
        tokenizer=str(model_dir),
    )
    assert not list(tmp_path.glob("*.safetensors"))
    out = llm.generate([1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5


def test_load_gguf_directly(tmp_path):
    """LLM() on the GGUF file itself: dequantized fp32 weights, the tokenizer from its metadata."""
    from quill.model.default_model import default_gguf_path

    llm = LLM(str(default_gguf_path()), dtype="float32", kv_cache_memory=16 << 20)
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=3, temperature=0))
    assert out[0].outputs[0].text.strip().startswith("Paris")


_GGUF_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
}  # fmt: skip


def _write_gguf(path, arch: str, ref, config: dict) -> None:
    """The checkpoint as llama.cpp's converter lays it out (names, stacked experts; qwen
    architectures keep q and k unpermuted), written with gguf's own writer."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    if arch == "qwen3moe":
        writer.add_expert_count(config["num_local_experts"])
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_weights_norm(config["norm_topk_prob"])
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    for name, w in state.items():
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            gguf_name = {"model.embed_tokens.weight": "token_embd.weight",
                         "model.norm.weight": "output_norm.weight",
                         "lm_head.weight": "output.weight"}[name]  # fmt: skip
            writer.add_tensor(gguf_name, w)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest == "mlp.experts.gate_up_proj":  # transformers 5 stacks the experts in memory:
            half = w.shape[1] // 2  # [experts, 2 * inter, hidden], gate rows then up rows
            writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", w[:, :half].copy())
            writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", w[:, half:].copy())
            continue
        if rest == "mlp.experts.down_proj":
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.weight", w)
            continue
        kind, _, suffix = rest.rpartition(".")
        writer.add_tensor(f"blk.{layer}.{_GGUF_LAYER_NAMES[kind]}.{suffix}", w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", ["qwen3", "qwen3moe"])
def test_gguf_of_qwen3_and_qwen3_moe_matches_transformers(tmp_path, model_dir, arch):
    import json

    ref = random_checkpoint(tmp_path, "qwen3" if arch == "qwen3" else "qwen3_moe", head_dim=32)
    config = json.loads(ref.config.to_json_string())
    path = tmp_path / f"tiny-{arch}.gguf"
    _write_gguf(path, arch, ref, config)
    llm = LLM(str(path), tokenizer=str(model_dir), dtype="float32", kv_cache_dtype="float32",
              quantization="none", kv_cache_memory=16 << 20)  # fmt: skip
    prompts = [[5, 17, 300, 4000], list(range(100, 190))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs, strict=True):
        t = torch.tensor([ids])
        with torch.inference_mode():
            expected = ref.generate(t, attention_mask=torch.ones_like(t), max_new_tokens=32,
                                    do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
        assert out.outputs[0].token_ids == expected[0, len(ids) :].tolist(), arch
