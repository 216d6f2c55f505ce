"""One API request as engine requests: fan-out, merged outputs, abort on disconnect, timings.

The engine serves one sequence per request, so `n` choices of `p` prompts become `p * n` engine
requests whose outputs arrive on one queue, tagged with their choice index (prompt-major, as
OpenAI numbers them). Whatever way the HTTP request ends (finished, client gone, error), the
engine requests still running are aborted, which frees their KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from quill.contract.errors import InvalidRequestError, OverloadedError
from quill.contract.outputs import RequestMetrics, RequestOutput
from quill.contract.sampling_params import SamplingParams
from quill.frontend.tokenizer import Tokenizer
from quill.server.context import ServerContext
from quill.server.engine_client import EngineFailure
from quill.server.errors import APIError, error_body

T = TypeVar("T")
log = logging.getLogger(__name__)


class RequestFailed(Exception):
    """A request ended by its own fault after it was admitted (its grammar failed on the way):
    a 4xx naming `param`, where an EngineFailure is the server's 5xx."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def api_error(self) -> APIError:
        return APIError(400, self.message, param=self.param, code="constraint_failed")


class Generation:
    """The engine requests behind one API request."""

    def __init__(
        self,
        ctx: ServerContext,
        request_id: str,
        arrival_time: float,
        constraint_field: str | None = None,
        client_request_id: str | None = None,
    ) -> None:
        """`constraint_field`: the request field its constraint came from, named when the
        engine refuses the constraint or a reply's grammar fails; `client_request_id`: the
        client's X-Request-Id, for the log (never the engine's id)."""
        self.ctx = ctx
        self.request_id = request_id
        self.client_request_id = client_request_id
        if client_request_id is not None:
            log.debug("%s: X-Request-Id %r", request_id, client_request_id)
        self.arrival_time = arrival_time
        self.constraint_field = constraint_field
        self.warnings: list[str] = []  # what of the constraint the engine does not enforce
        self.queue: asyncio.Queue = asyncio.Queue()
        self.engine_ids: list[str] = []
        self.prompt_lens: list[int] = []
        self.finished: dict[int, RequestOutput] = {}
        self.num_generated: dict[int, int] = {}  # tokens so far, per choice
        self.num_cached: dict[int, int] = {}  # prompt tokens found in the prefix cache, per choice

    async def submit(
        self,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],
        scheduling: dict | None = None,
        scoring_param: str = "prompt_logprobs",
        zipped: bool = False,
    ) -> None:
        """Add len(prompts) * len(params) engine requests (`zipped`: one a prompt, with its
        own params); all or none (InvalidRequestError). `scheduling`: priority, cache_salt and
        ttft_slo, as the engine's add_request takes them; `scoring_param`: the field named
        when too many prompt tokens are to be scored."""
        # A request that can never be served is a 400 whatever the load: every one is checked
        # (quill.frontend.inputs) before the queue is asked for room.
        inputs = self.ctx.engine.inputs
        requests = []
        for k, prompt in enumerate(prompts):
            self.prompt_lens.append(len(prompt))
            for p in [params[k]] if zipped else params:
                engine_id = f"{self.request_id}-{len(requests)}"
                requests.append(
                    inputs.make_request(
                        prompt, p, engine_id, self.arrival_time, **(scheduling or {})
                    )
                )
        self.ctx.check_capacity(len(requests), "prompt" if len(prompts) > 1 else "n")
        scoring = [r for r in requests if r.sampling_params.prompt_logprobs is not None]
        if scoring:
            num_scored = sum(len(r.prompt_token_ids) for r in scoring)
            self.ctx.check_prompt_logprobs(num_scored, scoring_param)
        self.engine_ids = [r.request_id for r in requests]
        try:
            self.warnings = await self.ctx.engine.add(requests, None, self.queue)
        except InvalidRequestError as e:
            self.abort()
            if e.param == "structured":  # the engine's name for the request's constraint
                self.ctx.metrics.structured_refused.inc()
                raise InvalidRequestError(e.message, self.constraint_field) from None
            raise
        except EngineFailure as e:
            self.abort()
            raise APIError(503, str(e), "server_error", headers={"Retry-After": "1"}) from e
        except OverloadedError as e:
            self.abort()
            self.ctx.metrics.refused_for_slo.inc()
            raise APIError(
                503,
                e.message,
                "server_error",
                code="overloaded",
                headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))},
            ) from e
        except BaseException:
            self.abort()
            raise

    @classmethod
    def for_request(cls, ctx: ServerContext, prefix: str, arrival_time: float, req, raw: Request):
        """The generation of an API request `req` (its constraint's field, where its API has
        constraints) that came as `raw` (its X-Request-Id), under a fresh id of the server's
        own: `prefix`-<hex>."""
        client_id = raw.headers.get("x-request-id")
        field = getattr(req, "constraint_field", None)
        return cls(ctx, ctx.request_id(prefix), arrival_time, field, client_id)

    @property
    def name(self) -> str:
        """The request in a log line: its id, and the client's X-Request-Id if it sent one."""
        given = self.client_request_id
        return self.request_id if given is None else f"{self.request_id} (X-Request-Id {given!r})"

    @property
    def num_choices(self) -> int:
        return len(self.engine_ids)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.num_choices

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, until every choice finished."""
        while not self.done:
            index, out = await self.queue.get()
            if isinstance(out, EngineFailure):
                raise out
            if out.outputs[0].finish_reason == "error":
                if out.error_param is not None:  # the request's own: its grammar failed
                    param = self.constraint_field if out.error_param == "structured" else None
                    raise RequestFailed(out.error or "the request failed", param)
                raise EngineFailure(out.error or "the engine failed this request")
            self.num_generated[index] = len(out.outputs[0].token_ids)
            if out.metrics.num_cached_tokens is not None:
                self.num_cached[index] = out.metrics.num_cached_tokens
            if out.finished:
                self.finished[index] = out
            yield index, out

    def abort(self) -> None:
        for index, engine_id in enumerate(self.engine_ids):
            if index not in self.finished:
                self.ctx.engine.abort(engine_id)

    @property
    def headers(self) -> dict[str, str]:
        """The reply's own headers: the engine's warnings about its constraint."""
        if not self.warnings:
            return {}
        return {"X-Quill-Warning": f"{self.constraint_field}: " + "; ".join(self.warnings)}

    def respond(self, reply: dict | Response) -> dict | Response:
        """A whole reply with the generation's headers."""
        if not self.warnings or isinstance(reply, Response):
            return reply
        return JSONResponse(reply, headers=self.headers)

    def stream(self, chunks: AsyncIterator[str]) -> StreamingResponse:
        """A streamed reply (server-sent events) with the generation's headers."""
        return StreamingResponse(
            event_stream(self, chunks), media_type="text/event-stream", headers=self.headers
        )

    # -- summaries ---------------------------------------------------------------------
    def usage(self) -> dict:
        prompt = sum(self.prompt_lens)
        completion = sum(self.num_generated.values())
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens()},
        }

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache. Each prompt counts once in
        `prompt_tokens`, so it counts its least-cached choice here (with `n` > 1 the other
        choices share the first one's blocks, and that saving shows in the step metrics)."""
        n = self.num_choices // max(len(self.prompt_lens), 1)
        total = 0
        for p in range(len(self.prompt_lens)):
            found = [self.num_cached.get(i, 0) for i in range(p * n, (p + 1) * n)]
            total += min(found, default=0)
        return total

    def timings(self) -> dict:
        timings = request_timings(
            [o.metrics for o in self.finished.values()], sum(self.prompt_lens)
        )
        timings["num_cached_tokens"] = self.cached_tokens()
        return timings


def request_timings(metrics: list[RequestMetrics], num_prompt_tokens: int) -> dict:
    """The request's own timings in seconds from its arrival at the server.

    With several choices these describe the whole: waiting ends when the first choice is
    scheduled, the first token is the first of any choice, the end is when the last one ends.
    For one choice they are exactly the engine's numbers.
    """

    def pick(fn, values):
        values = [v for v in values if v is not None]
        return fn(values) if values else None

    queue = pick(min, [m.queue_time for m in metrics])
    ttft = pick(min, [m.time_to_first_token for m in metrics])
    predicted_ttft = pick(min, [m.predicted_time_to_first_token for m in metrics])
    e2e = pick(max, [m.e2e_latency for m in metrics])
    gaps = [
        (m.mean_inter_token_latency, m.num_generation_tokens - 1)
        for m in metrics
        if m.mean_inter_token_latency is not None
    ]
    count = sum(k for _, k in gaps)
    return {
        "queue_time": queue,
        "time_to_first_token": ttft,
        "predicted_time_to_first_token": predicted_ttft,
        "mean_inter_token_latency": sum(v * k for v, k in gaps) / count if count else None,
        "max_inter_token_latency": pick(max, [m.max_inter_token_latency for m in metrics]),
        "prefill_time": None if ttft is None or queue is None else ttft - queue,
        "decode_time": None if e2e is None or ttft is None else e2e - ttft,
        "e2e_latency": e2e,
        "num_prompt_tokens": num_prompt_tokens,
        "num_generation_tokens": sum(m.num_generation_tokens for m in metrics),
        "num_preemptions": sum(m.num_preemptions for m in metrics),
        # The request's share of what the steps it took part in cost (quill.cost.live).
        "flops": pick(sum, [m.flops for m in metrics]),
        "bytes_moved": pick(sum, [m.bytes_moved for m in metrics]),
        "cost_usd": pick(sum, [m.cost_usd for m in metrics]),
        # The prompt's KV from a prefill instance (disaggregation), when it came from one.
        "kv_transfer_bytes": pick(sum, [m.kv_transfer_bytes for m in metrics]),
        "kv_transfer_s": pick(max, [m.kv_transfer_s for m in metrics]),
        # Speculative decoding: drafts verified for the request, and those accepted.
        "num_draft_tokens": sum(m.num_draft_tokens for m in metrics),
        "num_accepted_tokens": sum(m.num_accepted_tokens for m in metrics),
    }


# -- transport ---------------------------------------------------------------------------
def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


def typed_sse(events) -> str:
    """Events named by their `type` (the Responses and Messages APIs' streams)."""
    return "".join(f"event: {e['type']}\n{sse(e)}" for e in events)


async def event_stream(gen: Generation, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Server-sent events ending in [DONE]; an engine failure becomes an error event."""
    try:
        try:
            async for chunk in chunks:
                yield chunk
        except EngineFailure as e:
            yield sse(error_body(str(e), "server_error"))
        except RequestFailed as e:
            yield sse(e.api_error().body())
        except Exception:  # a bug here must still end the stream in a way clients understand
            log.exception("stream %s failed", gen.name)
            yield sse(error_body("internal server error", "server_error"))
        yield "data: [DONE]\n\n"
    finally:
        # Also reached when the client went away: starlette cancels the stream then.
        gen.abort()


async def unless_disconnected(
    request: Request, gen: Generation, work: Callable[[], Awaitable[T]]
) -> T | Response:
    """Run `work`, aborting the generation if the client disconnects before it is done."""
    task = asyncio.ensure_future(work())
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():
            task.cancel()
        watch.cancel()
        gen.abort()
    if not task.done() or task.cancelled():
        return Response(status_code=499)  # nobody reads it; the client is gone
    try:
        return task.result()
    except EngineFailure as e:
        raise APIError(500, str(e), "server_error") from e
    except RequestFailed as e:
        raise e.api_error() from e


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def token_text(tokenizer: Tokenizer, token_id: int) -> str:
    """One token as text, for logprobs (special tokens shown, not dropped)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)


def json_logprob(value: float | None) -> float | None:
    """JSON has no -inf or NaN; OpenAI reports impossible tokens as -9999.0."""
    if value is None or value != value:
        return None
    return max(value, -9999.0)
