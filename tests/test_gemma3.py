"""Gemma 3 270M from its wheels (`make models`) against transformers on the same GGUF (fp32):
greedy tokens on the reference prompts, the longest past the 512-key sliding window of its
local layers, and the first token's log-probabilities."""

from __future__ import annotations

import pytest
import torch

from quill import LLM, SamplingParams
from quill.model.named_models import named_model_path
from tests.conftest import PROMPTS


@pytest.fixture(scope="module")
def gemma_path():
    return named_model_path("gemma3-270m")  # a clear error, not a skip, without `make models`


def test_gemma3_270m_matches_transformers(gemma_path, monkeypatch):
    import gguf
    from transformers import AutoModelForCausalLM

    llm = LLM("gemma3-270m", dtype="float32", kv_cache_dtype="float32", quantization="none",
              kv_cache_memory=96 << 20)  # fmt: skip
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 600  # past the sliding window
    # 8 tokens past prompts longer than the window: the window's effect is in every one, and
    # transformers' reference pass is most of this test's time on a 2-core machine.
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=3)
    outs = llm.generate(prompts, params, use_tqdm=False)
    llm.close()
    # transformers reads the file's metadata twice (its config, then its tensors), and the
    # 262k-entry vocabulary makes each read ~15 s here: one parse, its own conversion twice.
    readers, parse = {}, gguf.GGUFReader

    def read_once(path, *args, **kwargs):
        key = str(path)
        if key not in readers:
            readers[key] = parse(path, *args, **kwargs)
        return readers[key]

    monkeypatch.setattr(gguf, "GGUFReader", read_once)
    ref = AutoModelForCausalLM.from_pretrained(
        str(gemma_path.parent), gguf_file=gemma_path.name, dtype=torch.float32
    ).eval()
    assert len(readers) == 1
    for ids, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        # One pass over the prompt and quill's tokens: transformers' greedy choice after each
        # prefix must be quill's next token (as its generation would be, in one pass).
        # Only the rows that predict quill's tokens go through the 262k-word head.
        with torch.inference_mode():
            passed = ref(torch.tensor([ids + tokens]), logits_to_keep=len(tokens) + 1)
            logits = passed.logits[0, :-1].float()
        assert logits.argmax(-1).tolist() == tokens, f"{len(ids)} tokens"
        first = logits[0].log_softmax(-1)
        for token, logprob in out.outputs[0].logprobs[0].items():
            assert logprob == pytest.approx(first[token].item(), abs=2e-3)
