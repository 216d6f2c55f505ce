"""The engine: requests in, one scheduled model pass per step, incremental outputs out.

`add_request` and `abort_request` are safe to call from other threads (the HTTP server's event
loop): they validate at once, so bad input fails in the caller, and queue the change for the
next step. `step` runs in one thread only.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

from quill.config import EngineConfig
from quill.engine.block_pool import KVCacheManager
from quill.engine.clock import WallClock
from quill.engine.detokenizer import IncrementalDetokenizer
from quill.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quill.engine.request import Request
from quill.engine.scheduler import Scheduler
from quill.engine.tokenizer import Tokenizer
from quill.errors import InvalidRequestError
from quill.model.loader import load_model, resolve_device, resolve_dtype
from quill.model.runner import ModelRunner
from quill.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """What one step did; the server turns these into Prometheus metrics."""

    num_prefill_tokens: int
    num_decode_tokens: int
    num_scheduled_requests: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    duration: float

    @property
    def num_batched_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class _Tracked:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[dict[int, float]] | None
    num_sent_tokens: int = 0


class LLMEngine:
    """Continuous batching over a paged KV cache; see the scheduler for the policy."""

    def __init__(self, config: EngineConfig, clock=None) -> None:
        self.config = config
        self.clock = clock or WallClock()
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        if config.model is None:
            from quill.model.default_model import default_model_dir

            model_path = default_model_dir()
        else:
            model_path = Path(config.model).expanduser()
        loaded = load_model(model_path, config.load_format, self.dtype, self.device)
        self.model_config = loaded.config
        self.model_path = model_path
        tok_source = Path(config.tokenizer) if config.tokenizer else loaded.source
        self.tokenizer = Tokenizer.load(tok_source, loaded.config.eos_token_ids)
        ctx = loaded.config.max_position_embeddings
        self.max_model_len = min(config.max_model_len or ctx, ctx)
        budget = config.max_num_batched_tokens or (512 if self.device.type == "cpu" else 8192)
        self.runner = ModelRunner(
            loaded.model, self.device, self.dtype, config.block_size, config.seed
        )
        num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(num_blocks)
        kv = KVCacheManager(num_blocks, config.block_size)
        self.scheduler = Scheduler(kv, budget, config.max_num_seqs, self.max_model_len)
        if config.compile:
            from quill.model.compile import compile_runner

            compile_runner(self.runner, budget)
        self._log_pool(num_blocks)
        self._pending: deque[tuple[str, object]] = deque()
        self._lock = threading.Lock()
        self._live_ids: set[str] = set()
        self._tracked: dict[str, _Tracked] = {}
        self.last_step: StepStats | None = None

    # -- set-up ----------------------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        per_block = self.runner.kv_bytes_per_block()
        if self.config.kv_cache_memory is not None:
            budget = self.config.kv_cache_memory
        elif self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * 0.85)
        else:
            budget = min(int(_available_memory() * 0.25), 4 << 30)
        blocks_per_seq = -(-self.max_model_len // self.config.block_size)
        # No point holding more than every allowed sequence at full context.
        num_blocks = min(budget // per_block, blocks_per_seq * self.config.max_num_seqs)
        if num_blocks < 1:
            raise InvalidRequestError(
                f"kv_cache_memory {budget} bytes holds no block of {per_block} bytes",
                param="kv_cache_memory",
            )
        return int(num_blocks)

    def _log_pool(self, num_blocks: int) -> None:
        bs = self.config.block_size
        gib = num_blocks * self.runner.kv_bytes_per_block() / (1 << 30)
        full = num_blocks * bs / self.max_model_len
        log.info(
            "KV cache: %d blocks of %d tokens = %d tokens (%.2f GiB, %s); "
            "%.1f sequences of full context (%d tokens) fit",
            num_blocks,
            bs,
            num_blocks * bs,
            gib,
            self.dtype,
            full,
            self.max_model_len,
        )

    # -- requests (any thread) -------------------------------------------------------------
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Validate and queue a request for the next step; raises InvalidRequestError."""
        params = params or SamplingParams()
        request_id = request_id or uuid.uuid4().hex
        if isinstance(prompt, str):
            text = prompt
            token_ids = self.tokenizer.encode(prompt) if prompt else []
        else:
            text = None
            token_ids = list(prompt)
            vocab = self.model_config.vocab_size
            bad = [t for t in token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
            if bad:
                raise InvalidRequestError(
                    f"token id {bad[0]!r} is outside the vocabulary [0, {vocab})", param="prompt"
                )
        request = Request(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            arrival_time=self.clock.now() if arrival_time is None else arrival_time,
            max_tokens=self._resolve_max_tokens(len(token_ids), params),
            eos_token_id=self.tokenizer.eos_token_id,
            prompt=text,
        )
        if not self.scheduler.kv.can_ever_fit(len(token_ids) + 1):
            raise InvalidRequestError(
                f"prompt of {len(token_ids)} tokens can never fit in the KV cache "
                f"({self.scheduler.kv.num_blocks * self.config.block_size} tokens)",
                param="prompt",
            )
        with self._lock:
            if request_id in self._live_ids:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            self._live_ids.add(request_id)
            self._pending.append(("add", request))
        return request_id

    def _resolve_max_tokens(self, num_prompt_tokens: int, params: SamplingParams) -> int:
        if num_prompt_tokens == 0:
            raise InvalidRequestError("prompt is empty", param="prompt")
        room = self.max_model_len - num_prompt_tokens
        if room <= 0:
            raise InvalidRequestError(
                f"prompt has {num_prompt_tokens} tokens but the model's context is "
                f"{self.max_model_len} tokens",
                param="prompt",
            )
        if params.max_tokens is None:
            return room
        if params.max_tokens > room:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {num_prompt_tokens + params.max_tokens} tokens "
                f"({num_prompt_tokens} in the prompt, {params.max_tokens} in the completion).",
                param="max_tokens",
            )
        return params.max_tokens

    def abort_request(self, request_id: str) -> None:
        with self._lock:
            self._pending.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._pending) or self.scheduler.has_unfinished()

    @property
    def num_unscheduled(self) -> int:
        """Requests waiting for their first step: queued adds plus the scheduler's waiting."""
        with self._lock:
            queued = sum(1 for kind, _ in self._pending if kind == "add")
        return queued + self.scheduler.num_waiting

    # -- the step (engine thread) ------------------------------------------------------------
    def _drain_pending(self) -> list[RequestOutput]:
        outputs = []
        while True:
            with self._lock:
                if not self._pending:
                    return outputs
                kind, item = self._pending.popleft()
            if kind == "add":
                request: Request = item
                self.scheduler.add_request(request)
                self._tracked[request.request_id] = _Tracked(
                    request,
                    IncrementalDetokenizer(
                        self.tokenizer, request.prompt_token_ids, request.sampling_params.stop
                    ),
                    [] if request.sampling_params.logprobs is not None else None,
                )
            else:
                request = self.scheduler.finish_request(item, "abort")
                if request is not None:
                    outputs.append(self._finish(request))

    def step(self) -> list[RequestOutput]:
        """One pass of the model; returns an output for every request that advanced or ended."""
        outputs = self._drain_pending()
        start = self.clock.now()
        sched = self.scheduler.schedule(start)
        outputs += [self._finish(r) for r in sched.finished]
        if sched.is_empty:
            return outputs
        try:
            result = self.runner.execute(sched, self.scheduler.kv.block_tables)
        except Exception as e:  # one bad step must not take the engine down
            log.exception("step failed; failing its %d requests", len(sched.scheduled))
            for s in sched.scheduled:
                rid = s.request.request_id
                if self.scheduler.finish_request(rid, "error") is not None:
                    outputs.append(self._finish(s.request, error=f"{type(e).__name__}: {e}"))
            return outputs
        now = self.clock.now()
        advanced, finished = self.scheduler.update(sched, result.sampled, now)
        for request in advanced:
            tracked = self._tracked[request.request_id]
            token = request.output_token_ids[-1]
            if tracked.logprobs is not None:
                chosen, top = result.logprobs[request.request_id]
                entry = dict(top)
                entry[token] = chosen
                tracked.logprobs.append(entry)
            stop = tracked.detokenizer.add_token(token)
            if stop is not None and not request.is_finished:
                self.scheduler.finish_request(request.request_id, "stop", stop)
                finished.append(request)
        done = {r.request_id for r in finished}
        outputs += [self._finish(r) for r in finished]
        outputs += [
            self._output(self._tracked[r.request_id]) for r in advanced if r.request_id not in done
        ]
        prefill = sum(
            s.num_tokens
            for s in sched.scheduled
            if s.num_tokens > 1 or s.start < s.request.num_prompt_tokens
        )
        self.last_step = StepStats(
            num_prefill_tokens=prefill,
            num_decode_tokens=sched.num_batched_tokens - prefill,
            num_scheduled_requests=len(sched.scheduled),
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.scheduler.kv.usage,
            num_preemptions=len(sched.preempted),
            duration=now - start,
        )
        return outputs

    def _finish(self, request: Request, error: str | None = None) -> RequestOutput:
        request.times.finished = self.clock.now()
        tracked = self._tracked.pop(request.request_id, None)
        self.runner.free_request(request.request_id)
        with self._lock:
            self._live_ids.discard(request.request_id)
        if tracked is None:  # aborted before it was ever drained
            tracked = _Tracked(request, IncrementalDetokenizer(self.tokenizer, [], []), None)
        return self._output(tracked, error)

    def _output(self, tracked: _Tracked, error: str | None = None) -> RequestOutput:
        request = tracked.request
        finished = request.is_finished
        new_tokens = request.output_token_ids[tracked.num_sent_tokens :]
        delta_logprobs = None
        if tracked.logprobs is not None:
            delta_logprobs = tracked.logprobs[tracked.num_sent_tokens :]
        tracked.num_sent_tokens = request.num_output_tokens
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text,
            token_ids=list(request.output_token_ids),
            finish_reason=request.finish_reason if finished else None,
            stop_reason=request.stop_reason,
            logprobs=tracked.logprobs,
            delta_text=tracked.detokenizer.take_delta(finished),
            delta_token_ids=new_tokens,
            delta_logprobs=delta_logprobs,
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=RequestMetrics.of(request),
            error=error,
        )


def _available_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30
