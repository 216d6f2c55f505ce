"""Greedy output against Hugging Face transformers on the same weights (fp32), on --device."""

from __future__ import annotations

import pytest
import torch

from quill import SamplingParams
from tests.conftest import PROMPTS

# (id of the model, prompt, tokens) -> (the model, its tokens). The same references are asked
# for by several tests (the cache in each dtype against the same model): ~9 s a set here.
# Holding the model keeps its id from naming another while the entry lives.
_GREEDY: dict[tuple, tuple] = {}


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (computed once per model, prompt and length)."""
    key = (id(hf_model), tuple(prompt_ids), max_new_tokens)
    if key not in _GREEDY:
        _GREEDY[key] = (hf_model, _generate(hf_model, prompt_ids, max_new_tokens))
    return list(_GREEDY[key][1])


def _generate(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids], device=hf_model.device)
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.device
def test_greedy_matches_transformers_batched(llm, hf_model):
    prompt_ids = [[1]] + [llm.tokenizer.encode(p) for p in PROMPTS]
    lengths = [len(p) for p in prompt_ids]
    assert min(lengths) == 1 and max(lengths) > 1000, lengths
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompt_ids, params, use_tqdm=False)
    for ids, out in zip(prompt_ids, outputs, strict=True):
        expected = hf_greedy(hf_model, ids, 12)
        assert out.outputs[0].token_ids == expected, f"prompt of {len(ids)} tokens"


@pytest.mark.device
def test_logits_close_to_transformers(llm, hf_model):
    """The first sampled position's log-probabilities agree with the reference's."""
    ids = llm.tokenizer.encode(PROMPTS[4])
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    out = llm.generate([ids], params, use_tqdm=False)[0].outputs[0]
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids], device=hf_model.device)).logits[0, -1].log_softmax(-1)
    ours = out.logprobs[0]
    assert len(ours) == 5
    for token_id, logprob in ours.items():
        assert abs(logprob - ref[token_id].item()) < 1e-3
    assert set(ours) == set(ref.topk(5).indices.tolist())
