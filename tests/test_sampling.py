"""Sampling controls, stop conditions, logprobs and incremental detokenization."""

from __future__ import annotations

import pytest
import torch

from quill import SamplingParams
from quill.contract.errors import InvalidRequestError
from quill.engine.request import Request
from quill.frontend.detokenizer import IncrementalDetokenizer
from quill.model.sampler import _top_k_top_p, apply_penalties
from tests.conftest import PROMPTS

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def _tokens(llm, prompt, **kw):
    return llm.generate(prompt, SamplingParams(**kw), use_tqdm=False)[0].outputs[0]


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = _tokens(llm, PROMPTS[4], max_tokens=12, temperature=0, ignore_eos=True).token_ids
    assert (
        _tokens(
            llm, PROMPTS[4], max_tokens=12, temperature=1.5, top_k=1, ignore_eos=True, seed=3
        ).token_ids
        == greedy
    )
    assert (
        _tokens(
            llm, PROMPTS[4], max_tokens=12, temperature=1.5, top_p=1e-6, ignore_eos=True, seed=3
        ).token_ids
        == greedy
    )


def test_top_k_top_p_masks_by_hand():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0], [1.0, 2.0, 3.0, 4.0]])
    probs = logits.softmax(-1)
    params = [SamplingParams(top_k=2), SamplingParams(top_p=float(probs[1, 3] + 0.01))]
    out = _top_k_top_p(logits, params)
    assert torch.isfinite(out[0]).tolist() == [True, True, False, False]
    # row 2: the top token alone holds less than top_p, so the second is kept too
    assert torch.isfinite(out[1]).tolist() == [False, False, True, True]


def test_penalties_by_hand():
    logits = torch.tensor([[2.0, -2.0, 1.0, 0.5]])
    request = Request(
        "r",
        [3],
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        0.0,
        4,
    )
    request.output_token_ids = [0, 0, 1]
    out = apply_penalties(logits, [request])
    # token 0: seen twice: 2/2 - 0.25*2 - 0.5; token 1: -2*2 - 0.25 - 0.5; token 3: prompt only
    assert torch.allclose(out, torch.tensor([[1.0 - 0.5 - 0.5, -4.0 - 0.25 - 0.5, 1.0, 0.25]]))


def test_repetition_penalty_matches_transformers(llm, hf_model):
    ids = llm.tokenizer.encode(PROMPTS[3])
    ours = _tokens(llm, ids, max_tokens=16, temperature=0, repetition_penalty=1.3, ignore_eos=True)
    with torch.inference_mode():
        t = torch.tensor([ids])
        ref = hf_model.generate(
            t,
            attention_mask=torch.ones_like(t),
            max_new_tokens=16,
            do_sample=False,
            repetition_penalty=1.3,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
    assert ours.token_ids == ref


def test_stop_string_spanning_tokens(llm):
    full = _tokens(llm, PROMPTS[2], **GREEDY.__dict__)
    text = full.text
    # a stop string that starts inside one token and ends in a later one
    start = len(text) // 2
    stop = text[start : start + 5]
    assert len(stop) == 5
    out = _tokens(llm, PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == text[: text.index(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    full = _tokens(llm, PROMPTS[2], **GREEDY.__dict__).token_ids
    out = _tokens(
        llm, PROMPTS[2], max_tokens=24, temperature=0, ignore_eos=True, stop_token_ids=[full[5]]
    )
    assert out.finish_reason == "stop" and out.stop_reason == full[5]
    assert out.token_ids == full[: full.index(full[5]) + 1]
    out = _tokens(llm, PROMPTS[2], max_tokens=3, temperature=0)
    assert out.finish_reason == "length" and len(out.token_ids) == 3


def test_eos_stops_unless_ignored(llm):
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}])
    out = _tokens(llm, chat, max_tokens=200, temperature=0)
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in out.text
    out = _tokens(llm, chat, max_tokens=len(out.token_ids) + 3, temperature=0, ignore_eos=True)
    assert out.finish_reason == "length"


def test_logprobs(llm):
    out = _tokens(llm, PROMPTS[1], max_tokens=5, temperature=0, logprobs=3)
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and len(entry) == 3  # greedy: the chosen token is the top one
        assert max(entry, key=entry.get) == token
        assert all(v <= 0 for v in entry.values())


def test_streaming_deltas_add_up(llm):
    engine = llm.engine
    rid = engine.add_request(PROMPTS[4], SamplingParams(max_tokens=20, temperature=0, stop=["zzz"]))
    text, tokens = "", []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                text += out.outputs[0].delta_text
                tokens += out.outputs[0].delta_token_ids
                final = out
    assert final.finished
    assert text == final.outputs[0].text and tokens == final.outputs[0].token_ids
    assert final.metrics.time_to_first_token > 0 and final.metrics.num_generation_tokens == 20


def test_detokenizer_multibyte_utf8(llm):
    tok = llm.tokenizer
    text = "Grüße aus Köln: 東京は晴れ 🌞🚀 — ok"
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok, [], [])
    pieces = []
    for t in ids:
        detok.add_token(t)
        pieces.append(detok.take_delta(finished=False))
    pieces.append(detok.take_delta(finished=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text
    assert len(ids) > len([p for p in pieces if p])  # some characters did span tokens


def test_detokenizer_stop_string_held_back(llm):
    tok = llm.tokenizer
    ids = tok.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tok, [], ["gamma"])
    streamed = ""
    for t in ids:
        stop = detok.add_token(t)
        streamed += detok.take_delta(finished=stop is not None)
        if stop:
            break
    assert stop == "gamma"
    assert streamed == detok.text == "alpha beta "


def test_logit_bias_bars_and_forces_tokens(llm):
    prompt = "The capital of France is"
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = _tokens(llm, prompt, max_tokens=6, temperature=0, ignore_eos=True).token_ids
    banned = want[0]
    got = llm.generate([prompt], SamplingParams(**{**vars(greedy), "logit_bias": {banned: -100}}),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    assert got[0] != banned and banned not in got
    forced = 1234
    got = llm.generate([prompt], SamplingParams(**{**vars(greedy), "logit_bias": {forced: 100}}),
                       use_tqdm=False)[0].outputs[0].token_ids  # fmt: skip
    assert got == [forced] * 6
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(InvalidRequestError, match="outside the vocabulary") as e:
        llm.engine.add_request([1, 2], SamplingParams(logit_bias={10**6: 1.0}), "far")
    assert e.value.param == "logit_bias"
