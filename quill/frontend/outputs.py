"""The engine's per-step token updates as request outputs: text, stop strings, logprobs.

The engine sends token ids; the front end owns the text. Each request's tokens pass through
its incremental detokenizer, which finds stop strings: a request that hits one ends here at
once (its output says "stop") and the engine is told to end it (`on_stop`), so tokens the
engine made meanwhile are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from quill.contract.messages import RequestUpdate
from quill.contract.outputs import CompletionOutput, RequestMetrics, RequestOutput
from quill.contract.sampling_params import SamplingParams
from quill.frontend.detokenizer import IncrementalDetokenizer
from quill.frontend.tokenizer import Tokenizer

# on_stop(request id, stop string, the engine's last timings) -> the request's final timings
StopHandler = Callable[[str, str, RequestMetrics], RequestMetrics]


@dataclass
class _Tracked:
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] | None = None
    num_sent_tokens: int = 0
    prompt_logprobs: list[dict[int, float] | None] | None = None
    prompt_logprob_ranks: list[int | None] | None = None


class OutputProcessor:
    """Request outputs for the requests this front end added."""

    def __init__(self, tokenizer: Tokenizer, on_stop: StopHandler) -> None:
        self.tokenizer = tokenizer
        self.on_stop = on_stop
        self._tracked: dict[str, _Tracked] = {}

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self._tracked[request_id] = _Tracked(
            prompt,
            prompt_token_ids,
            params,
            IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
            ),
            logprobs=[] if params.logprobs is not None else None,
        )

    def discard(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._tracked

    def __len__(self) -> int:
        return len(self._tracked)

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """An output for each update of a request still tracked (one ended here by a stop
        string may still get updates from the engine: they are dropped)."""
        outputs = []
        for update in updates:
            tracked = self._tracked.get(update.request_id)
            if tracked is None:
                continue
            outputs.append(self._apply(update, tracked))
        return outputs

    def _apply(self, update: RequestUpdate, tracked: _Tracked) -> RequestOutput:
        finish_reason, stop_reason = update.finish_reason, update.stop_reason
        metrics = update.metrics
        new_tokens = update.new_token_ids
        last_in_text = len(new_tokens)
        if finish_reason is not None and not _text_includes_last_token(
            finish_reason, stop_reason, tracked.params
        ):
            last_in_text -= 1
        if update.prompt_logprobs is not None:
            self._take_prompt_logprobs(tracked, update.prompt_logprobs)
        logprobs = update.new_logprobs
        for i, token in enumerate(new_tokens):
            tracked.token_ids.append(token)
            if tracked.logprobs is not None and logprobs is not None and i < len(logprobs):
                chosen, top = logprobs[i]
                entry = dict(top)
                entry[token] = chosen
                tracked.logprobs.append(entry)
            if i >= last_in_text:
                continue
            stop = tracked.detokenizer.add_token(token)
            if stop is not None:
                if finish_reason is None:  # ends here; the engine is told to end it too
                    metrics = self.on_stop(update.request_id, stop, metrics)
                    finish_reason, stop_reason = "stop", stop
                break
        out = self._output(
            update.request_id,
            tracked,
            finish_reason,
            stop_reason,
            metrics,
            update.error,
            update.error_param,
        )
        out.kv_transfer = update.kv_lease
        if update.embedding is not None:
            out.embedding = update.embedding
        return out

    @staticmethod
    def _take_prompt_logprobs(tracked: _Tracked, scored: list) -> None:
        """As generated tokens' logprobs: {token id: logprob} with the prompt's own token in,
        None for the first prompt token (nothing before it predicts it)."""
        entries: list[dict[int, float] | None] = [None]
        for token, (chosen, _, top) in zip(tracked.prompt_token_ids[1:], scored):
            entry = dict(top)
            entry[token] = chosen
            entries.append(entry)
        tracked.prompt_logprobs = entries
        tracked.prompt_logprob_ranks = [None] + [rank for _, rank, _ in scored]

    def _output(
        self,
        request_id: str,
        tracked: _Tracked,
        finish_reason: str | None,
        stop_reason,
        metrics: RequestMetrics,
        error: str | None,
        error_param: str | None = None,
    ) -> RequestOutput:
        finished = finish_reason is not None
        if finished:
            del self._tracked[request_id]
        sent = tracked.num_sent_tokens
        tracked.num_sent_tokens = len(tracked.token_ids)
        completion = CompletionOutput(
            index=0,
            text=tracked.detokenizer.text,
            token_ids=list(tracked.token_ids),
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            logprobs=tracked.logprobs,
            delta_text=tracked.detokenizer.take_delta(finished),
            delta_token_ids=tracked.token_ids[sent:],
            delta_logprobs=None if tracked.logprobs is None else tracked.logprobs[sent:],
        )
        return RequestOutput(
            request_id=request_id,
            prompt=tracked.prompt,
            prompt_token_ids=tracked.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            metrics=metrics,
            error=error,
            error_param=error_param,
            prompt_logprobs=tracked.prompt_logprobs,
            prompt_logprob_ranks=tracked.prompt_logprob_ranks,
        )


def _text_includes_last_token(finish_reason: str, stop_reason, params: SamplingParams) -> bool:
    """A reply ended by an end-of-sequence or stop token id keeps that token out of its text
    (it stays in token_ids), unless include_stop_str_in_output; as in vLLM."""
    ended_by_token = finish_reason == "stop" and not isinstance(stop_reason, str)
    return not ended_by_token or params.include_stop_str_in_output
