"""The server through the official openai client, checked against the offline engine."""

from __future__ import annotations

import asyncio

import openai
import pytest
from server_helpers import API_KEY

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
CHAT = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What colour is the sky?"},
]
TIMING_KEYS = {
    "queue_time",
    "time_to_first_token",
    "mean_inter_token_latency",
    "max_inter_token_latency",
    "prefill_time",
    "decode_time",
    "e2e_latency",
    "num_prompt_tokens",
    "num_generation_tokens",
}


def check_timings(m: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert TIMING_KEYS <= m.keys()
    assert m["num_prompt_tokens"] == prompt_tokens
    assert m["num_generation_tokens"] == completion_tokens
    assert 0 <= m["queue_time"] <= m["time_to_first_token"] <= m["e2e_latency"]
    assert m["prefill_time"] == pytest.approx(m["time_to_first_token"] - m["queue_time"])
    assert m["decode_time"] == pytest.approx(m["e2e_latency"] - m["time_to_first_token"])
    if completion_tokens > 1:
        assert 0 < m["mean_inter_token_latency"] <= m["max_inter_token_latency"]


def test_models_health_version(client, http, model_name):
    assert [m.id for m in client.models.list().data] == [model_name]
    assert client.models.retrieve(model_name).id == model_name
    assert http.get("/health").json() == {"status": "ok"}
    assert http.get("/version").json()["version"]


def test_completion_matches_offline(client, greedy, offline, model_name):
    resp = client.completions.create(model=model_name, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert resp.object == "text_completion" and resp.model == model_name
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert [c.text for c in resp.choices] == greedy(PROMPTS, 8)
    prompt_tokens = sum(len(offline.tokenizer.encode(p)) for p in PROMPTS)
    completion_tokens = sum(len(offline.tokenizer.encode(c.text, False)) for c in resp.choices)
    assert resp.usage.prompt_tokens == prompt_tokens
    assert resp.usage.total_tokens == prompt_tokens + resp.usage.completion_tokens
    assert resp.usage.completion_tokens >= completion_tokens - 3  # re-encoding may merge tokens
    check_timings(resp.model_extra["metrics"], prompt_tokens, resp.usage.completion_tokens)


def test_completion_stream_matches_offline(client, greedy, model_name):
    stream = client.completions.create(
        model=model_name,
        prompt=PROMPTS,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finish, chunks = ["", "", ""], [None] * 3, list(stream)
    for chunk in chunks[:-1]:
        assert chunk.usage is None and len(chunk.choices) == 1
        c = chunk.choices[0]
        texts[c.index] += c.text
        finish[c.index] = finish[c.index] or c.finish_reason
    assert texts == greedy(PROMPTS, 8)
    assert all(f in ("stop", "length") for f in finish)
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens > 0
    check_timings(
        last.model_extra["metrics"], last.usage.prompt_tokens, last.usage.completion_tokens
    )


def test_chat_matches_offline(client, greedy, model_name):
    resp = client.chat.completions.create(
        model=model_name, messages=CHAT, max_completion_tokens=10, temperature=0
    )
    (choice,) = resp.choices
    assert resp.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.message.content == greedy([CHAT], 10, chat=True)[0]
    check_timings(
        resp.model_extra["metrics"], resp.usage.prompt_tokens, resp.usage.completion_tokens
    )


def test_chat_stream_matches_offline(client, greedy, model_name):
    stream = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=10, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert text == greedy([CHAT], 10, chat=True)[0]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    metrics = chunks[-1].model_extra["metrics"]  # no usage requested: on the finishing chunk
    assert metrics["num_generation_tokens"] >= 1
    assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])


def test_async_client_both_endpoints(base_url, greedy, model_name):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0)
        async with aclient:
            comp = await aclient.completions.create(
                model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0
            )
            chat = await aclient.chat.completions.create(
                model=model_name, messages=CHAT, max_tokens=6, temperature=0
            )
            comp_stream = await aclient.completions.create(
                model=model_name, prompt=PROMPTS[0], max_tokens=6, temperature=0, stream=True
            )
            comp_text = "".join([c.choices[0].text async for c in comp_stream])
            chat_stream = await aclient.chat.completions.create(
                model=model_name, messages=CHAT, max_tokens=6, temperature=0, stream=True
            )
            chat_text = "".join([c.choices[0].delta.content or "" async for c in chat_stream])
        return comp.choices[0].text, chat.choices[0].message.content, comp_text, chat_text

    comp, chat, comp_text, chat_text = asyncio.run(main())
    assert comp == comp_text == greedy([PROMPTS[0]], 6)[0]
    assert chat == chat_text == greedy([CHAT], 6, chat=True)[0]


def test_token_id_prompts(client, greedy, offline, model_name):
    ids = [offline.tokenizer.encode(p) for p in PROMPTS[:2]]
    one = client.completions.create(model=model_name, prompt=ids[0], max_tokens=6, temperature=0)
    many = client.completions.create(model=model_name, prompt=ids, max_tokens=6, temperature=0)
    expected = greedy(PROMPTS[:2], 6)
    assert one.choices[0].text == expected[0]
    assert [c.text for c in many.choices] == expected


def test_echo(client, greedy, offline, model_name):
    resp = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=5, temperature=0, echo=True
    )
    assert resp.choices[0].text == PROMPTS[0] + greedy([PROMPTS[0]], 5)[0]
    ids = offline.tokenizer.encode(PROMPTS[1])
    streamed = client.completions.create(
        model=model_name, prompt=ids, max_tokens=5, temperature=0, echo=True, stream=True
    )
    text = "".join(c.choices[0].text for c in streamed)
    assert text == offline.tokenizer.decode(ids) + greedy([PROMPTS[1]], 5)[0]


def test_n_choices_and_seed(client, greedy, model_name):
    greedy_two = client.completions.create(
        model=model_name, prompt=PROMPTS[2], n=2, max_tokens=6, temperature=0
    )
    assert [c.text for c in greedy_two.choices] == greedy([PROMPTS[2]], 6) * 2
    kwargs = dict(model=model_name, messages=CHAT, n=3, max_tokens=8, temperature=1.0, seed=7)
    first = client.chat.completions.create(**kwargs)
    again = client.chat.completions.create(**kwargs)
    texts = [c.message.content for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert texts == [c.message.content for c in again.choices]  # seeded: reproducible
    assert len(set(texts)) > 1  # seed + i: the choices differ
    metrics = first.model_extra["metrics"]  # the whole request: all three choices
    assert metrics["num_generation_tokens"] == first.usage.completion_tokens


def test_completion_logprobs_match_offline(client, offline, model_name):
    from quill.contract.sampling_params import SamplingParams

    resp = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=2
    )
    lp = resp.choices[0].logprobs
    ref = offline.generate(
        PROMPTS[0], SamplingParams(max_tokens=5, temperature=0, logprobs=2), use_tqdm=False
    )[0].outputs[0]
    assert "".join(lp.tokens) == resp.choices[0].text
    expected = [entry[t] for t, entry in zip(ref.token_ids, ref.logprobs)]
    assert lp.token_logprobs == pytest.approx(expected, abs=1e-4)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and max(top.values()) == pytest.approx(chosen)  # greedy
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_chat_top_logprobs(client, model_name):
    resp = client.chat.completions.create(
        model=model_name, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=3
    )
    content = resp.choices[0].logprobs.content
    assert "".join(t.token for t in content) == resp.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert t.top_logprobs[0].token == t.token and tops[0] == pytest.approx(t.logprob)
        assert bytes(t.bytes).decode() == t.token


def test_stop_string(client, greedy, model_name):
    resp = client.completions.create(
        model=model_name, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=["\n"]
    )
    choice = resp.choices[0]
    assert "\n" not in choice.text
    assert choice.text == greedy([PROMPTS[1]], 24, stop=["\n"])[0]
    if choice.finish_reason == "stop":
        assert choice.model_extra["stop_reason"] == "\n"


def test_tokenize_detokenize(http, offline, model_name):
    ids = offline.tokenizer.encode(PROMPTS[0])
    r = http.post("/tokenize", json={"model": model_name, "prompt": PROMPTS[0]})
    assert r.status_code == 200
    assert r.json()["tokens"] == ids and r.json()["count"] == len(ids)
    chat = http.post("/tokenize", json={"messages": CHAT}).json()
    assert chat["tokens"] == offline.tokenizer.encode(offline.tokenizer.apply_chat_template(CHAT))
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPTS[0]}
