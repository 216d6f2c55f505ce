"""The soak test's traffic: every kind of request it sends, and how each answer is judged.

A soak test only finds leaks and crashes if it sends what real clients send, the bad with the
good: streams read to the end and streams dropped halfway, requests given up on, malformed
bodies, bodies too large, bodies that never finish, and bursts past the queue bound. Each kind
here sends one request (a burst, many) and records one Outcome per request: "ok", the expected
4xx code, "503" (refused with Retry-After: correct under load), "client_disconnect" (we left on
purpose) or "failure" with the reason. Streams also record when each token arrived.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import httpx

# Short prompts: what most chat and completion traffic looks like.
_PROMPTS = [
    "Write a haiku about the sea.",
    "What is the capital of France?",
    "Explain recursion in one sentence.",
    "List three colours of the rainbow.",
    "The old lighthouse keeper opened the door and",
    "Once upon a time, in a small village,",
    "Give me a tip for learning to cook.",
    "Why is the sky blue?",
    "def fibonacci(n):",
    "Translate 'good morning' into Spanish.",
]
# About 11 tokens; repeated to make the ~1500-token prompts that are prefilled in chunks.
_LONG_SENTENCE = "The quick brown fox jumps over the lazy dog near the quiet river bank. "
_LONG_REPEATS = 135


@dataclass
class Outcome:
    """One request's fate; times are seconds of the client's monotonic clock."""

    traffic: str  # which kind of request (see Traffic.KINDS, plus "burst")
    outcome: str  # "ok", "400", "401", ..., "503", "client_disconnect", "failure"
    started: float
    ended: float
    detail: str | None = None  # why it failed


@dataclass
class Recorder:
    """Everything the run saw, as flat time-stamped lists, cut into windows afterwards."""

    outcomes: list[Outcome] = field(default_factory=list)
    ttft: list[tuple[float, float]] = field(default_factory=list)  # (first token at, seconds)
    itl: list[tuple[float, float]] = field(default_factory=list)  # (token at, gap seconds)
    tokens: list[tuple[float, int]] = field(default_factory=list)  # (arrived at, output tokens)

    def add(self, traffic: str, outcome: str, started: float, detail: str | None = None) -> Outcome:
        out = Outcome(traffic, outcome, started, time.monotonic(), detail)
        self.outcomes.append(out)
        return out


def _tokens_in(chunk: dict) -> int:
    """Tokens one streamed chunk carries: its logprob entries (we always ask for them, so that
    each token comes as a chunk of its own), else one per chunk that has text."""
    n = 0
    for choice in chunk.get("choices") or []:
        lp = choice.get("logprobs")
        if lp:
            n += len(lp.get("tokens") or lp.get("content") or [])
        elif choice.get("text") or (choice.get("delta") or {}).get("content"):
            n += 1
    return n


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


class Traffic:
    """Sends each kind of request against one server and records what came back."""

    # name -> default weight of the mix each worker draws from.
    KINDS = {
        "stream_completion": 20,
        "stream_chat": 20,
        "completion": 10,
        "chat": 10,
        "long_prompt": 4,
        "stream_disconnect": 5,
        "timeout_cancel": 5,
        "bad_input": 15,
        "raw_half_body": 2,
        "raw_stall": 1,
    }
    # The kinds whose client leaves before the answer is complete (or never sends it whole).
    LEAVERS = ("stream_disconnect", "timeout_cancel", "raw_half_body", "raw_stall")

    def __init__(
        self,
        client: httpx.AsyncClient,
        model: str,
        host: str,
        port: int,
        api_key: str,
        body_timeout: float,
        max_request_bytes: int,
        recorder: Recorder,
    ) -> None:
        self.client = client
        self.model = model
        self.host, self.port = host, port
        self.api_key = api_key
        self.body_timeout = body_timeout
        self.max_request_bytes = max_request_bytes
        self.rec = recorder
        self._bad: dict[str, tuple[int, Callable[[random.Random], httpx.Request]]] = {
            "malformed_json": (400, self._malformed_json),
            "wrong_type": (400, lambda r: self._post(self._body(r, max_tokens="eight"))),
            "top_k_2**64": (400, lambda r: self._post(self._body(r, top_k=2**64))),
            "temperature_5": (400, lambda r: self._post(self._body(r, temperature=5))),
            "max_tokens_0": (400, lambda r: self._post(self._body(r, max_tokens=0))),
            "unknown_model": (404, lambda r: self._post(self._body(r, model="no-such-model"))),
            "unsupported_logit_bias": (
                400,
                lambda r: self._post(self._body(r, logit_bias={"50256": -100})),
            ),
            "not_an_object": (400, lambda r: self._post_raw(b"[1, 2, 3]")),
            "bad_chat_role": (
                400,
                lambda r: self._post(
                    self._body(r, chat=True, messages=[{"role": "wizard", "content": "hi"}]), True
                ),
            ),
            "too_many_seqs": (
                400,
                lambda r: self._post(self._body(r, prompt=[r.choice(_PROMPTS)] * 300)),
            ),
            "prompt_too_long": (
                400,
                lambda r: self._post(self._body(r, prompt=_LONG_SENTENCE * 800)),
            ),
            "oversize_declared": (413, self._oversize_declared),
            "oversize_chunked": (413, self._oversize_chunked),
            "text_plain": (415, self._text_plain),
            "missing_api_key": (401, lambda r: self._without_key(self._post(self._body(r)))),
            "wrong_api_key": (401, self._wrong_key),
        }

    # -- request bodies ---------------------------------------------------------------------
    def _body(self, rng: random.Random, chat: bool = False, **overrides) -> dict:
        """A valid request with short, varied sampling settings; `overrides` break it."""
        prompt = rng.choice(_PROMPTS)
        body: dict = {"model": self.model, "max_tokens": rng.randint(8, 64)}
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        body["temperature"] = rng.choice([0.0, 0.7, 1.0])
        if rng.random() < 0.3:
            body["seed"] = rng.randrange(1 << 31)
        if rng.random() < 0.3:
            body["top_p"] = 0.9
        if rng.random() < 0.1:
            # Unknown fields are ignored: a client's extension must not break its request.
            body["x_soak_unknown_field"] = {"nested": [1, 2]}
        body.update(overrides)
        return body

    def _stream_body(self, rng: random.Random, chat: bool, **overrides) -> dict:
        body = self._body(rng, chat, stream=True, **overrides)
        body["stream_options"] = {"include_usage": True}
        # One logprob entry per token makes each token its own chunk, so every gap is one ITL.
        if chat:
            body |= {"logprobs": True, "top_logprobs": 0}
        else:
            body["logprobs"] = 0
        return body

    @staticmethod
    def _path(chat: bool) -> str:
        return "/v1/chat/completions" if chat else "/v1/completions"

    def _post(self, body: dict, chat: bool = False) -> httpx.Request:
        return self.client.build_request("POST", self._path(chat), json=body)

    def _post_raw(self, content, content_type: str = "application/json") -> httpx.Request:
        return self.client.build_request(
            "POST", "/v1/completions", content=content, headers={"Content-Type": content_type}
        )

    def _malformed_json(self, rng: random.Random) -> httpx.Request:
        text = json.dumps(self._body(rng))
        return self._post_raw(text[: rng.randint(1, len(text) - 1)].encode())

    def _oversize_declared(self, rng: random.Random) -> httpx.Request:
        # Content-Length says it all: the server may answer before the body is read.
        pad = b"a" * (self.max_request_bytes + 1)
        return self._post_raw(b'{"prompt": "' + pad + b'"}')

    def _oversize_chunked(self, rng: random.Random) -> httpx.Request:
        # No Content-Length: the server has to count while it reads.
        size = self.max_request_bytes

        async def chunks() -> AsyncIterator[bytes]:
            yield b'{"prompt": "'
            piece = b"a" * (64 << 10)
            sent = 0
            while sent <= size:
                yield piece
                sent += len(piece)
            yield b'"}'

        return self._post_raw(chunks())

    def _text_plain(self, rng: random.Random) -> httpx.Request:
        return self._post_raw(json.dumps(self._body(rng)).encode(), "text/plain")

    def _without_key(self, request: httpx.Request) -> httpx.Request:
        del request.headers["Authorization"]
        return request

    def _wrong_key(self, rng: random.Random) -> httpx.Request:
        request = self._post(self._body(rng))
        request.headers["Authorization"] = "Bearer not-the-key"
        return request

    # -- judging answers --------------------------------------------------------------------
    def _judge_status(
        self, traffic: str, started: float, response: httpx.Response, expected: int
    ) -> str:
        """Record a non-streamed answer's status; returns the outcome."""
        code = response.status_code
        if code == expected:
            return self.rec.add(traffic, "ok" if code == 200 else str(code), started).outcome
        if code == 503 and response.headers.get("retry-after"):
            return self.rec.add(traffic, "503", started).outcome
        detail = f"expected {expected}, got {code}"
        if code == 503:
            detail += " without Retry-After"
        try:
            detail += ": " + _short(response.text)
        except (httpx.ResponseNotRead, UnicodeDecodeError):
            pass
        return self.rec.add(traffic, "failure", started, detail).outcome

    def _connection_failure(self, traffic: str, started: float, e: BaseException) -> None:
        self.rec.add(traffic, "failure", started, f"{type(e).__name__}: {_short(str(e))}")

    # -- the kinds of traffic ---------------------------------------------------------------
    async def run(self, kind: str, rng: random.Random) -> None:
        """Send one request of `kind` (a key of KINDS)."""
        runner: dict[str, Callable[[random.Random], Awaitable[None]]] = {
            "stream_completion": lambda r: self.stream(r, chat=False),
            "stream_chat": lambda r: self.stream(r, chat=True),
            "completion": lambda r: self.plain(r, chat=False),
            "chat": lambda r: self.plain(r, chat=True),
            "long_prompt": self.long_prompt,
            "stream_disconnect": self.stream_disconnect,
            "timeout_cancel": self.timeout_cancel,
            "bad_input": self.bad_input,
            "raw_half_body": self.raw_half_body,
            "raw_stall": self.raw_stall,
        }
        await runner[kind](rng)

    async def stream(
        self,
        rng: random.Random,
        chat: bool,
        traffic: str | None = None,
        stop_after: int | None = None,
        **overrides,
    ) -> None:
        """A streamed request read to [DONE] (or, with `stop_after`, left after that many
        tokens); TTFT and every inter-token gap of a finished stream are recorded."""
        traffic = traffic or ("stream_chat" if chat else "stream_completion")
        body = self._stream_body(rng, chat, **overrides)
        started = time.monotonic()
        times: list[float] = []
        usage = None
        try:
            async with self.client.stream("POST", self._path(chat), json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    self._judge_status(traffic, started, response, 200)
                    return
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    now = time.monotonic()
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        detail = f"error event in stream: {_short(json.dumps(chunk['error']))}"
                        self.rec.add(traffic, "failure", started, detail)
                        return
                    times.extend([now] * _tokens_in(chunk))
                    usage = chunk.get("usage") or usage
                    if stop_after is not None and len(times) >= stop_after:
                        # Leaving the block closes the connection mid-stream.
                        self.rec.add(traffic, "client_disconnect", started)
                        return
                else:
                    self.rec.add(traffic, "failure", started, "stream ended without [DONE]")
                    return
        except (httpx.HTTPError, OSError, json.JSONDecodeError) as e:
            self._connection_failure(traffic, started, e)
            return
        if usage is None:
            self.rec.add(traffic, "failure", started, "no usage chunk despite include_usage")
            return
        if usage.get("completion_tokens") != len(times):
            detail = f"usage says {usage.get('completion_tokens')} tokens, {len(times)} streamed"
            self.rec.add(traffic, "failure", started, detail)
            return
        self.rec.add(traffic, "ok", started)
        if times:
            self.rec.ttft.append((times[0], times[0] - started))
            self.rec.itl.extend((b, b - a) for a, b in zip(times, times[1:]))
            self.rec.tokens.extend((t, 1) for t in times)

    async def plain(
        self, rng: random.Random, chat: bool, traffic: str | None = None, **overrides
    ) -> None:
        """A non-streamed request; its tokens count when the answer arrives."""
        traffic = traffic or ("chat" if chat else "completion")
        body = self._body(rng, chat, **overrides)
        started = time.monotonic()
        try:
            response = await self.client.post(self._path(chat), json=body)
        except (httpx.HTTPError, OSError) as e:
            self._connection_failure(traffic, started, e)
            return
        if self._judge_status(traffic, started, response, 200) != "ok":
            return
        try:
            data = response.json()
            tokens = data["usage"]["completion_tokens"]
            if not data["choices"]:
                raise ValueError("no choices")
        except (ValueError, KeyError, TypeError) as e:
            self.rec.outcomes[-1].outcome = "failure"
            self.rec.outcomes[-1].detail = f"malformed 200 answer: {type(e).__name__}: {e}"
            return
        self.rec.tokens.append((time.monotonic(), tokens))

    async def long_prompt(self, rng: random.Random) -> None:
        # A distinct head keeps prompts apart should the server ever cache prefixes.
        text = f"Note {rng.randrange(1 << 30)}. " + _LONG_SENTENCE * _LONG_REPEATS
        chat = rng.random() < 0.5
        field = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        await self.stream(rng, chat, traffic="long_prompt", **field)

    async def stream_disconnect(self, rng: random.Random) -> None:
        # 64 tokens so that the stream is still going when we leave after a few.
        await self.stream(
            rng,
            rng.random() < 0.5,
            traffic="stream_disconnect",
            stop_after=rng.randint(1, 5),
            max_tokens=64,
        )

    async def timeout_cancel(self, rng: random.Random) -> None:
        """A non-streamed request given up on by a short client timeout."""
        chat = rng.random() < 0.5
        started = time.monotonic()
        body = self._body(rng, chat, max_tokens=64)
        try:
            response = await self.client.post(
                self._path(chat), json=body, timeout=rng.uniform(0.1, 0.5)
            )
        except httpx.TimeoutException:
            self.rec.add("timeout_cancel", "client_disconnect", started)
            return
        except (httpx.HTTPError, OSError) as e:
            self._connection_failure("timeout_cancel", started, e)
            return
        self._judge_status("timeout_cancel", started, response, 200)

    def hostile_cases(self) -> list[str]:
        """What the hostile loop cycles through: every invalid request by name, then the kinds
        that leave early, so each is exercised however slowly the server generates."""
        return [*sorted(self._bad), *self.LEAVERS]

    async def hostile(self, case: str, rng: random.Random) -> None:
        """One case of hostile_cases()."""
        if case in self._bad:
            await self.bad_input(rng, case)
        else:
            await self.run(case, rng)

    async def bad_input(self, rng: random.Random, name: str | None = None) -> None:
        """One of the invalid requests (`name`, else drawn), which must get its own 4xx."""
        name = name or rng.choice(sorted(self._bad))
        expected, build = self._bad[name]
        traffic = f"bad:{name}"
        started = time.monotonic()
        try:
            response = await self.client.send(build(rng))
        except (httpx.HTTPError, OSError) as e:
            self._connection_failure(traffic, started, e)
            return
        self._judge_status(traffic, started, response, expected)

    def _raw_head(self, length: int) -> bytes:
        return (
            "POST /v1/completions HTTP/1.1\r\n"
            f"Host: {self.host}:{self.port}\r\n"
            f"Authorization: Bearer {self.api_key}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n"
        ).encode()

    async def raw_half_body(self, rng: random.Random) -> None:
        """Headers and half the body, then the socket closes: the server must just let go."""
        started = time.monotonic()
        body = json.dumps(self._body(rng)).encode()
        try:
            _, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(self._raw_head(len(body)) + body[: len(body) // 2])
            await writer.drain()
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            writer.close()
            await writer.wait_closed()
        except OSError as e:
            self._connection_failure("raw_half_body", started, e)
            return
        self.rec.add("raw_half_body", "client_disconnect", started)

    async def raw_stall(self, rng: random.Random) -> None:
        """Headers and half the body, then nothing: the server must answer 408 in time."""
        started = time.monotonic()
        body = json.dumps(self._body(rng)).encode()
        writer = None
        try:
            reader, writer = await asyncio.open_connection(self.host, self.port)
            writer.write(self._raw_head(len(body)) + body[: len(body) // 2])
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), self.body_timeout + 15)
        except (OSError, TimeoutError) as e:
            self._connection_failure("raw_stall", started, e)
            return
        finally:
            if writer is not None:
                writer.close()
                try:
                    await writer.wait_closed()
                except OSError:
                    pass
        parts = status_line.decode("latin-1").split()
        code = parts[1] if len(parts) > 1 else ""
        waited = time.monotonic() - started
        if code != "408":
            detail = f"expected 408, got {status_line[:80]!r} after {waited:.1f} s"
            self.rec.add("raw_stall", "failure", started, detail)
        elif waited < self.body_timeout * 0.9:
            detail = f"408 after {waited:.1f} s, before the {self.body_timeout:g} s timeout"
            self.rec.add("raw_stall", "failure", started, detail)
        else:
            self.rec.add("raw_stall", "408", started)

    async def burst(self, rng: random.Random, size: int) -> None:
        """`size` requests at once, past the queue bound: some must be refused with 503."""
        seeds = [rng.randrange(1 << 62) for _ in range(size)]

        async def one(seed: int) -> None:
            r = random.Random(seed)
            if r.random() < 0.5:
                await self.stream(r, r.random() < 0.5, traffic="burst", max_tokens=8)
            else:
                await self.plain(r, r.random() < 0.5, traffic="burst", max_tokens=8)

        await asyncio.gather(*(one(s) for s in seeds))
