"""Scoring prompts through the API, as evaluation harnesses ask: echo with logprobs and
max_tokens 0 on /v1/completions (OpenAI's legacy format, read through the openai client),
vLLM's prompt_logprobs on both endpoints; the numbers are the offline engine's."""

from __future__ import annotations

import openai
import pytest

from quill.contract.sampling_params import SamplingParams

PROMPT = "The quick brown fox jumps over the lazy dog. Then the dog ran after the fox"
# Two-byte characters split over tokens, and a word in Greek: offsets count characters.
UNICODE_PROMPT = "Café, naïve résumé: λόγος means word."


def offline_scored(offline, prompt, top_n: int):
    out = offline.generate(
        prompt, SamplingParams(max_tokens=0, prompt_logprobs=top_n), use_tqdm=False
    )[0]
    return out


def check_echoed_prompt(logprobs, prompt_text: str, ids: list[int], scored, tok, top_n: int):
    """The legacy object's first len(ids) entries: the prompt's tokens, null first, each
    token's text where its offset says in the echoed text, the top n and the token there."""
    k = len(ids)
    assert logprobs.tokens[:k] == [tok.decode([t], skip_special_tokens=False) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for i in range(1, k):
        assert logprobs.token_logprobs[i] == pytest.approx(scored[i][ids[i]], abs=1e-4)
        top = logprobs.top_logprobs[i]
        assert logprobs.tokens[i] in top and top_n <= len(top) <= top_n + 1
    offsets = logprobs.text_offset[:k]
    assert offsets[0] == 0 and offsets == sorted(offsets)
    # Each token's text is where its offset says (the whole text is ASCII-free of splits, or
    # the token's piece is a prefix of the text from there).
    for i, (start, token) in enumerate(zip(offsets, logprobs.tokens[:k])):
        if "\ufffd" not in token:
            assert prompt_text.startswith(token, start), (i, token, start)


def test_echo_max_tokens_zero_returns_the_prompt_scored(client, offline, model_name):
    tok = offline.tokenizer
    ids = tok.encode(PROMPT)
    resp = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=0, echo=True, logprobs=2, temperature=0
    )
    choice = resp.choices[0]
    assert choice.text == PROMPT
    assert choice.finish_reason == "length"
    assert resp.usage.prompt_tokens == len(ids) and resp.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(ids)
    scored = offline_scored(offline, PROMPT, 2).prompt_logprobs
    check_echoed_prompt(lp, PROMPT, ids, scored, tok, 2)


def test_echo_then_generated_tokens(client, offline, model_name):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, max_tokens
    1, several prompts at once; each choice is the prompt's scored tokens and then one more."""
    tok = offline.tokenizer
    prompts = [tok.encode(PROMPT), tok.encode("def add(a, b):\n    return a + b")]
    resp = client.completions.create(
        model=model_name, prompt=prompts, max_tokens=1, echo=True, logprobs=1, temperature=0
    )
    assert [c.index for c in resp.choices] == [0, 1]
    for ids, choice in zip(prompts, resp.choices):
        plain = offline.generate(
            ids, SamplingParams(max_tokens=1, temperature=0, logprobs=1), use_tqdm=False
        )[0].outputs[0]
        echo_text = tok.decode(ids)
        assert choice.text == echo_text + plain.text
        lp = choice.logprobs
        assert len(lp.tokens) == len(ids) + 1
        scored = offline_scored(offline, ids, 1).prompt_logprobs
        check_echoed_prompt(lp, echo_text, ids, scored, tok, 1)
        assert lp.token_logprobs[-1] == pytest.approx(
            plain.logprobs[0][plain.token_ids[0]], abs=1e-4
        )
        assert lp.text_offset[-1] == len(echo_text)
        # What the harness computes: the continuation's loglikelihood and whether greedy.
        ctxlen = 3
        continuation = lp.token_logprobs[ctxlen:-1]
        assert sum(continuation) == pytest.approx(
            sum(scored[i][ids[i]] for i in range(ctxlen, len(ids))), abs=1e-4
        )
        for chosen, top in zip(continuation, lp.top_logprobs[ctxlen:-1]):
            assert chosen <= max(top.values())


def test_text_offsets_index_the_echoed_text(client, offline, model_name):
    tok = offline.tokenizer
    for prompt in (UNICODE_PROMPT, tok.encode(UNICODE_PROMPT)):
        resp = client.completions.create(
            model=model_name, prompt=prompt, max_tokens=4, echo=True, logprobs=0, temperature=0
        )
        choice = resp.choices[0]
        offsets = choice.logprobs.text_offset
        ids = tok.encode(UNICODE_PROMPT)
        echoed = choice.text[: offsets[len(ids)]] if len(offsets) > len(ids) else choice.text
        assert echoed == UNICODE_PROMPT
        assert offsets == sorted(offsets) and offsets[-1] < len(choice.text)
        # Decoding the tokens up to each offset gives the text before it.
        for i in range(len(ids)):
            before = tok.decode(ids[:i])
            if "\ufffd" not in before:
                assert choice.text[: offsets[i]] == before, i


def test_streamed_echo_with_logprobs(client, offline, model_name):
    tok = offline.tokenizer
    ids = tok.encode(PROMPT)
    kwargs = dict(
        model=model_name, prompt=PROMPT, max_tokens=3, echo=True, logprobs=1, temperature=0
    )
    whole = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    tokens, chosen, offsets = [], [], []
    for c in chunks:
        if c.choices[0].logprobs is not None:
            tokens += c.choices[0].logprobs.tokens
            chosen += c.choices[0].logprobs.token_logprobs
            offsets += c.choices[0].logprobs.text_offset
    assert tokens == whole.choices[0].logprobs.tokens
    assert offsets == whole.choices[0].logprobs.text_offset
    assert chosen[0] is None and len(chosen) == len(ids) + 3
    assert chosen[1:] == pytest.approx(whole.choices[0].logprobs.token_logprobs[1:], abs=1e-6)


def check_vllm_prompt_logprobs(items, ids, scored, ranks, tok, top_n: int):
    assert len(items) == len(ids) and items[0] is None
    for i in range(1, len(ids)):
        item = items[i]
        assert str(ids[i]) in item
        assert top_n <= len(item) <= top_n + 1
        own = item[str(ids[i])]
        assert own["logprob"] == pytest.approx(scored[i][ids[i]], abs=1e-4)
        assert own["rank"] == ranks[i]
        assert own["decoded_token"] == tok.decode([ids[i]], skip_special_tokens=False)
        others = sorted(v["rank"] for k, v in item.items() if k != str(ids[i]))
        assert others == [r for r in range(1, top_n + 2) if r != ranks[i]][: len(others)]


def test_vllm_prompt_logprobs_on_completions(client, offline, model_name):
    tok = offline.tokenizer
    ids = tok.encode(PROMPT)
    resp = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=2,
        temperature=0,
        extra_body={"prompt_logprobs": 3},
    )
    choice = resp.choices[0]
    assert choice.logprobs is None  # legacy logprobs were not asked for
    reference = offline_scored(offline, PROMPT, 3)
    items = choice.model_extra["prompt_logprobs"]
    check_vllm_prompt_logprobs(
        items, ids, reference.prompt_logprobs, reference.prompt_logprob_ranks, tok, 3
    )


def test_vllm_prompt_logprobs_on_chat(client, offline, model_name):
    tok = offline.tokenizer
    messages = [{"role": "user", "content": "Name a colour."}]
    resp = client.chat.completions.create(
        model=model_name,
        messages=messages,
        max_tokens=2,
        temperature=0,
        n=2,
        extra_body={"prompt_logprobs": 1},
    )
    text = tok.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, add_special_tokens=False)
    reference = offline.generate(
        ids, SamplingParams(max_tokens=0, prompt_logprobs=1), use_tqdm=False
    )[0]
    items = resp.model_extra["prompt_logprobs"]
    check_vllm_prompt_logprobs(
        items, ids, reference.prompt_logprobs, reference.prompt_logprob_ranks, tok, 1
    )
    assert resp.usage.prompt_tokens == len(ids)
    # max_tokens 0 with prompt_logprobs: the prompt scored, no reply.
    resp = client.chat.completions.create(
        model=model_name, messages=messages, max_tokens=0, extra_body={"prompt_logprobs": 0}
    )
    assert resp.choices[0].message.content == ""
    assert resp.choices[0].finish_reason == "length"
    assert len(resp.model_extra["prompt_logprobs"]) == len(ids)


def test_too_many_prompt_tokens_to_score_is_400(client, model_name, server):
    bound = server.ctx.max_prompt_logprobs_tokens
    prompt = "word " * 200
    copies = bound // 200 + 1
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model_name, prompt=[prompt] * copies, max_tokens=0, echo=True, logprobs=0
        )
    assert e.value.body["param"] == "logprobs"
    assert "--max-prompt-logprobs-tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=model_name,
            prompt=prompt,
            n=copies,
            max_tokens=1,
            extra_body={"prompt_logprobs": 0},
        )
    assert e.value.body["param"] == "prompt_logprobs"
    # The server goes on serving.
    ok = client.completions.create(model=model_name, prompt="Hello", max_tokens=1)
    assert ok.choices[0].finish_reason == "length"
