"""Bad input gets a clear error naming the problem, and the engine keeps serving the others."""

from __future__ import annotations

import json

import pytest

from quill import LLM, SamplingParams
from quill.contract.errors import InvalidRequestError, ModelLoadError
from tests.conftest import PROMPTS


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": 3.0}, "presence_penalty"),
        ({"logprobs": 50}, "logprobs"),
    ],
)
def test_bad_sampling_params(kwargs, param):
    with pytest.raises(InvalidRequestError, match=param) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_bad_requests_do_not_disturb_others(llm):
    engine = llm.engine
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    expected = llm.generate(PROMPTS[1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    good = engine.add_request(PROMPTS[1], greedy)
    engine.step()
    too_long = [5] * (engine.max_model_len + 1)
    cases = [
        ("", SamplingParams(), "prompt is empty"),
        ([], SamplingParams(), "prompt is empty"),
        (too_long, SamplingParams(), "context"),
        ([1, 2, 10**9], SamplingParams(), "outside the vocabulary"),
        ("Hi", SamplingParams(max_tokens=engine.max_model_len), "maximum context length"),
    ]
    for prompt, params, message in cases:
        with pytest.raises(InvalidRequestError, match=message):
            engine.add_request(prompt, params)
        engine.step()
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("Hi", greedy, request_id=good)
    final = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final = out
    assert final.request_id == good
    assert final.outputs[0].token_ids == expected
    assert engine.scheduler.kv.usage == 0


def test_prompt_that_never_fits_the_pool(model_dir):
    tiny = LLM(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        kv_cache_memory=4 * 16 * 30 * 2 * 3 * 64 * 4,
    )
    assert tiny.engine.scheduler.kv.num_blocks == 4
    with pytest.raises(InvalidRequestError, match="never fit in the KV cache"):
        tiny.generate([7] * 100, SamplingParams(max_tokens=2))
    out = tiny.generate([7] * 10, SamplingParams(max_tokens=2, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 2


def test_step_failure_fails_only_that_step(llm, monkeypatch):
    engine = llm.engine
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    victim = engine.add_request(PROMPTS[2], greedy)
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    outs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs] == [(victim, "error")]
    assert "injected fault" in outs[0].error
    assert engine.scheduler.kv.usage == 0
    out = llm.generate(PROMPTS[2], greedy, use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 4


def test_unknown_model_path():
    with pytest.raises(ModelLoadError, match="does-not-exist"):
        LLM("/nonexistent/does-not-exist", dtype="float32")


def test_gguf_of_unsupported_architecture(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match="unsupported GGUF architecture 'mamba'"):
        LLM(str(path), dtype="float32")


def test_hf_directory_of_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel") as refused:
        LLM(str(tmp_path), dtype="float32")
    for known in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM"):
        assert known in str(refused.value)  # the refusal lists what quill runs


@pytest.mark.parametrize(
    "field, value, why",
    [
        ("partial_rotary_factor", 0.75, "partial_rotary_factor"),
        ("rope_scaling", {"rope_type": "longrope", "short_factor": [1.0]}, "longrope"),
        ("use_sliding_window", True, "use_sliding_window"),
    ],
)
def test_a_config_field_quill_does_not_model_is_refused(tmp_path, model_dir, field, value, why):
    config = json.loads((model_dir / "config.json").read_text())
    if field == "use_sliding_window":  # Qwen's opt-in window
        config |= {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 64}
    (tmp_path / "config.json").write_text(json.dumps({**config, field: value}))
    with pytest.raises(ModelLoadError, match=why):
        LLM(str(tmp_path), load_format="dummy", tokenizer=str(model_dir), dtype="float32")


def test_tensor_of_wrong_shape(tmp_path, model_dir):
    import json

    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    config["num_hidden_layers"] = 1
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(
        {"model.embed_tokens.weight": torch.zeros(10, 3)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ModelLoadError, match=r"model.embed_tokens.weight.*shape \(10, 3\)"):
        LLM(str(tmp_path), dtype="float32")
