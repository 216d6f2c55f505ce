"""The HTTP benchmark's clients: text prompts of a set token length, and closed-loop streaming.

quill.bench.client sends an open-loop workload; bench_http.py needs N clients that each send
their next request when the last one ends, against quill, llama-server and vLLM. This draws
text prompts of an exact token length and runs the closed loop on that client's records; the
stream reader (quill.bench.client) counts each server's tokens the way it says them: quill's
one logprob per token, llama-server's running `timings.predicted_n`, vLLM's running
`usage.completion_tokens` (`stream_options.continuous_usage_stats`).
"""

from __future__ import annotations

import asyncio
import functools
import random
import time

import httpx

from quill.bench.client import random_prompt
from quill.bench.stream import StreamRecord, stream_request
from quill.model.default_model import default_model_dir


@functools.cache
def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(default_model_dir() / "tokenizer.json"))


def text_prompts(count: int, length: int, seed: int) -> list[str]:
    """`count` texts of `length` tokens of the default model's tokenizer, made of random whole
    words so that encoding the decoded text gives back (almost always) as many tokens."""
    tok = _tokenizer()
    words = sorted(
        i
        for t, i in tok.get_vocab().items()
        if t[:1] == "Ġ" and t[1:].isascii() and t[1:].isalpha()
    )
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        ids = random_prompt(length, rng, words)
        for _ in range(4):  # a word may encode differently next to its neighbours: trim, top up
            text = tok.decode(ids)
            got = tok.encode(text, add_special_tokens=False).ids
            if len(got) == length:
                break
            ids = (got + random_prompt(length, rng, words))[:length]
        texts.append(text)
    return texts


async def closed_loop(
    url: str, prompts: list[str], clients: int, max_tokens: int, extra_body: dict
) -> list[StreamRecord]:
    """`clients` clients, each streaming its share of `prompts` one request after the other."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    records: list[StreamRecord] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one_client(mine: list[tuple[int, str]]) -> None:
            for i, prompt in mine:
                record = StreamRecord(i, 0, max_tokens, scheduled=0.0)
                records.append(record)
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
                body |= {"ignore_eos": True, "temperature": 0, "stream": True}
                body |= {"stream_options": {"include_usage": True}, **extra_body}
                await stream_request(client, "/v1/completions", body, record, time.monotonic)

        numbered = list(enumerate(prompts))
        await asyncio.gather(*(one_client(numbered[k::clients]) for k in range(clients)))
    return records
