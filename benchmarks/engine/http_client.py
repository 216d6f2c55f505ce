"""The HTTP benchmark's clients: text prompts of a set token length, and closed-loop streaming.

quill.bench.client sends an open-loop workload and reads only the OpenAI `logprobs.tokens` of
each chunk; bench_http.py needs N clients that each send their next request when the last one
ends, against quill and against llama-server, which sends its logprobs in another shape (and
would slow down computing them). This keeps that client's record (RequestRecord), summary and
prompt drawing, and counts the tokens of either server's chunks.
"""

from __future__ import annotations

import asyncio
import functools
import json
import random
import time

import httpx

from quill.bench.client import RequestRecord, random_prompt
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


def _new_tokens(chunk: dict, counted: int) -> int:
    """Tokens a chunk brings: llama-server's running count, or quill's one logprob per token
    (the OpenAI completions format that quill.bench.client reads)."""
    timings = chunk.get("timings")
    if timings and "predicted_n" in timings:
        return max(timings["predicted_n"] - counted, 0)
    choices = chunk.get("choices") or []
    return sum(len((c.get("logprobs") or {}).get("tokens") or []) for c in choices)


async def stream_one(client: httpx.AsyncClient, record: RequestRecord, body: dict) -> None:
    """One streamed completion into `record`, every token timestamped as it arrives."""
    record.sent = time.monotonic()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if line == "data: [DONE]":
                    record.finished = now
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    record.error = f"stream error: {chunk['error']}"
                    return
                n = _new_tokens(chunk, record.output_tokens)
                record.chunk_times.extend([now] * n)
                record.output_tokens += n
                if usage := chunk.get("usage"):
                    record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            if record.finished is None:
                record.error = "stream ended without [DONE]"
    except httpx.HTTPError as e:
        record.error = f"{type(e).__name__}: {e}"


async def closed_loop(
    url: str, prompts: list[str], clients: int, max_tokens: int, extra_body: dict
) -> list[RequestRecord]:
    """`clients` clients, each streaming its share of `prompts` one request after the other."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]

        async def one_client(mine: list[tuple[int, str]]) -> None:
            for i, prompt in mine:
                record = RequestRecord(f"req-{i}", 0, max_tokens, scheduled=0.0)
                records.append(record)
                body = {"model": model, "prompt": prompt, "max_tokens": max_tokens}
                body |= {"ignore_eos": True, "temperature": 0, "stream": True}
                body |= {"stream_options": {"include_usage": True}, **extra_body}
                await stream_one(client, record, body)

        numbered = list(enumerate(prompts))
        await asyncio.gather(*(one_client(numbered[k::clients]) for k in range(clients)))
    return records
