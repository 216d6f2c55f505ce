"""The compiled, bucketed path gives the same tokens as eager (tiny model: compiling is slow)."""

from __future__ import annotations

from quill import LLM, SamplingParams
from quill.model.compile import bucket_sizes
from tests.conftest import write_tiny_config


def test_bucket_sizes():
    assert bucket_sizes(512) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def test_compiled_matches_eager(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("QUILL_CACHE", str(tmp_path / "cache"))
    write_tiny_config(tmp_path, model_dir, hidden_size=64)
    options = dict(
        load_format="dummy",
        dtype="float32",
        quantization="none",
        kv_cache_memory=4 << 20,
        tokenizer=str(model_dir),
        max_num_batched_tokens=16,
    )
    prompts = [[1, 2, 3], list(range(40, 60)), [9]]
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    eager = LLM(str(tmp_path), **options).generate(prompts, params, use_tqdm=False)
    compiled_llm = LLM(str(tmp_path), compile=True, **options)
    compiled = compiled_llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in compiled] == [o.outputs[0].token_ids for o in eager]
    # Steps of 3, 16 and 1..3 tokens ran, padded to buckets; only bucket sizes were compiled.
    seen = compiled_llm.engine.runner.forward.seen
    assert seen and seen <= set(bucket_sizes(16))


def test_decode_steps_compiled_alone_match_eager(tmp_path, model_dir, monkeypatch):
    """A GPU's way (decode steps alone compiled, as CUDA graphs there; here the same compiled
    graphs without them): prompt chunks eager, decode steps compiled, the same tokens."""
    from quill.model.compile import compile_runner

    monkeypatch.setenv("QUILL_CACHE", str(tmp_path / "cache"))
    write_tiny_config(tmp_path, model_dir, hidden_size=64)
    options = dict(load_format="dummy", dtype="float32", quantization="none",
                   kv_cache_memory=4 << 20, tokenizer=str(model_dir))  # fmt: skip
    prompt = [list(range(40, 60))]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    eager = LLM(str(tmp_path), **options).generate(prompt, params, use_tqdm=False)
    llm = LLM(str(tmp_path), **options)
    runner = llm.engine.runner
    compile_runner(runner, llm.engine.config.max_num_batched_tokens or 512, decode_only=True)
    compiled = llm.generate(prompt, params, use_tqdm=False)
    assert compiled[0].outputs[0].token_ids == eager[0].outputs[0].token_ids
    assert runner.decode_forward.seen == {1}  # the prompt ran eager; one decode bucket compiled
    assert runner.forward == runner.model.forward
