"""Prometheus metrics, named as vLLM names them but prefixed `quill:` (and exposed again under
vLLM's own names for the routers that read those: quill/server/vllm_metrics.py).

The wait and the pace are kept apart: queue time and time to first token say how long a request
waited, inter-token latency and decode time say how fast it then ran. Request timings come from
the engine's RequestMetrics, whose clock starts at the request's arrival at the server. All
updates happen in the engine thread, once per step.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from quill.contract.messages import KVTransferStats, SpecDecodeStats, StepStats, StructuredStats
from quill.contract.outputs import RequestOutput
from quill.server.console.state import ConsoleState
from quill.server.vllm_metrics import VLLMNamedMetrics

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0,
)  # fmt: skip
_ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
)  # fmt: skip
_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
_STEP_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12,
)  # fmt: skip
_FRACTION_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.5)


_KV_TRANSFER_COUNTERS = (  # KVTransferStats field, metric, help
    ("fetches", "kv_transfers", "Prompts' KV received from prefill instances."),
    ("fetched_bytes", "kv_transfer_bytes", "Bytes of prompt KV received from prefill instances."),
    ("fetch_failures", "kv_transfer_failures", "KV fetches that failed (peer gone, timeout)."),
    ("recomputes", "kv_recomputes", "Failed KV fetches whose prompt was computed here."),
    (
        "transferred_prompt_tokens",
        "kv_transferred_prompt_tokens",
        "Prompt tokens computed here for requests whose KV came from a prefill instance.",
    ),
    ("sends", "kv_sends", "Leased prompt KV sent to decode instances."),
    ("sent_bytes", "kv_sent_bytes", "Bytes of prompt KV sent to decode instances."),
    ("lease_expiries", "kv_lease_expiries", "Leased prompt KV freed unfetched (lease ended)."),
)


_STRUCTURED_COUNTERS = (  # StructuredStats field, metric, help
    ("grammars_compiled", "structured_grammars_compiled", "Constrained requests' matchers made."),
    ("compile_seconds", "structured_compile_seconds", "Seconds spent making matchers."),
    ("masks", "structured_masks", "Token masks computed (a constrained row in a step)."),
    ("mask_seconds", "structured_mask_seconds", "Seconds spent computing token masks."),
    ("over_budget", "structured_over_budget", "Replies ended: a token mask over its budget."),
)


_SPEC_COUNTERS = (  # SpecDecodeStats field, metric, help (vLLM's spec_decode names; quill's
    # own last two: how often the proposer finds drafts, which the simulator needs)
    ("num_drafts", "spec_decode_num_drafts", "Requests' steps verified with drafts."),
    ("num_draft_tokens", "spec_decode_num_draft_tokens", "Draft tokens proposed and verified."),
    ("num_accepted_tokens", "spec_decode_num_accepted_tokens", "Draft tokens accepted."),
    ("num_eligible", "spec_decode_num_eligible", "Decodes the proposer was asked for drafts."),
    ("num_proposed", "spec_decode_num_proposed", "Of those, decodes it found drafts for."),
)


class ServerMetrics:
    """One registry per server, so that several servers in one process (tests) stay apart."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.console = ConsoleState()  # the last minute, for the console page
        labels = ["model_name"]
        r = self.registry

        parents = []  # every metric, for their vLLM names (quill/server/vllm_metrics.py)

        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"quill:{name}", doc, labels, buckets=buckets, registry=r)

        def one(metric):
            parents.append(metric)
            return metric.labels(model_name=model_name)

        self.ttft = one(
            hist("time_to_first_token_seconds", "Arrival to first token.", _LATENCY_BUCKETS)
        )
        self.itl = one(hist("inter_token_latency_seconds", "Gap between tokens.", _ITL_BUCKETS))
        self.e2e = one(hist("e2e_request_latency_seconds", "Arrival to finish.", _LATENCY_BUCKETS))
        self.queue = one(
            hist("request_queue_time_seconds", "Arrival to first scheduled.", _LATENCY_BUCKETS)
        )
        self.prefill = one(
            hist(
                "request_prefill_time_seconds", "First scheduled to first token.", _LATENCY_BUCKETS
            )
        )
        self.decode = one(
            hist("request_decode_time_seconds", "First token to finish.", _LATENCY_BUCKETS)
        )
        self.iteration_tokens = one(
            hist("iteration_tokens_total", "Tokens computed per engine step.", _TOKEN_BUCKETS)
        )
        self.batch_size = one(
            hist(
                "iteration_batch_size",
                "Requests that produced a token in one engine step.",
                _TOKEN_BUCKETS,
            )
        )
        self.prompt_len = one(
            hist("request_prompt_tokens", "Prompt tokens per finished request.", _TOKEN_BUCKETS)
        )
        self.gen_len = one(
            hist(
                "request_generation_tokens",
                "Generated tokens per finished request.",
                _TOKEN_BUCKETS,
            )
        )
        self.running = one(
            Gauge("quill:num_requests_running", "Requests running.", labels, registry=r)
        )
        self.waiting = one(
            Gauge("quill:num_requests_waiting", "Requests waiting.", labels, registry=r)
        )
        self.kv_usage = one(
            Gauge("quill:kv_cache_usage_perc", "KV cache usage (1 = full).", labels, registry=r)
        )
        self.preemptions = one(
            Counter(
                "quill:num_preemptions", "Preemptions (recomputed requests).", labels, registry=r
            )
        )
        self.prompt_tokens = one(
            Counter(
                "quill:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=r
            )
        )
        self.generation_tokens = one(
            Counter(
                "quill:generation_tokens",
                "Generated tokens of finished requests.",
                labels,
                registry=r,
            )
        )
        # The cost model beside the measurement (only when the engine has a hardware spec).
        self.step_predicted = one(
            hist("step_predicted_seconds", "Cost model's price of each step.", _STEP_BUCKETS)
        )
        self.step_measured = one(
            hist("step_measured_seconds", "Measured wall time of each step.", _STEP_BUCKETS)
        )
        self.step_efficiency = one(
            hist(
                "step_roofline_efficiency",
                "Roofline bound / measured step time (1 = at the hardware's floor).",
                _FRACTION_BUCKETS,
            )
        )
        self.mfu = one(
            Gauge(
                "quill:model_flops_utilization",
                "Last step's FLOPs / (time x the hardware's peak FLOP/s).",
                labels,
                registry=r,
            )
        )
        self.mbu = one(
            Gauge(
                "quill:model_bandwidth_utilization",
                "Last step's bytes moved / (time x the hardware's memory bandwidth).",
                labels,
                registry=r,
            )
        )
        self.prefix_cache_queries = one(
            Counter(
                "quill:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (at each admission).",
                labels,
                registry=r,
            )
        )
        self.prefix_cache_hits = one(
            Counter(
                "quill:prefix_cache_hits",
                "Prompt tokens found in the prefix cache (not computed again).",
                labels,
                registry=r,
            )
        )
        self.refused_for_slo = one(
            Counter(
                "quill:num_requests_refused_slo",
                "Requests refused at arrival: predicted time to first token over the SLO.",
                labels,
                registry=r,
            )
        )
        self.predicted_ttft = one(
            hist(
                "predicted_time_to_first_token_seconds",
                "Admission control's prediction of each finished request's time to first token.",
                _LATENCY_BUCKETS,
            )
        )
        self._prefix_seen = (0, 0)  # the engine's running totals already counted
        # Disaggregation (quill/disagg), from the engine's running totals.
        self._kv_counters = {
            field: one(Counter(f"quill:{name}", doc, labels, registry=r))
            for field, name, doc in _KV_TRANSFER_COUNTERS
        }
        self._kv_seen = KVTransferStats()
        # Structured output (quill/structured), from the engine's running totals.
        self._structured_counters = {
            field: one(Counter(f"quill:{name}", doc, labels, registry=r))
            for field, name, doc in _STRUCTURED_COUNTERS
        }
        self._structured_seen = StructuredStats()
        # Speculative decoding (quill/engine/speculative.py), from the engine's running totals.
        self._spec_counters = {
            field: one(Counter(f"quill:{name}", doc, labels, registry=r))
            for field, name, doc in _SPEC_COUNTERS
        }
        self._spec_per_position = Counter(
            "quill:spec_decode_num_accepted_tokens_per_pos",
            "Drafts accepted through each draft position (0: the first draft).",
            labels + ["position"],
            registry=r,
        )
        self.spec_acceptance = one(
            Gauge(
                "quill:spec_decode_acceptance_rate",
                "Accepted / proposed draft tokens since start.",
                labels,
                registry=r,
            )
        )
        self.spec_allowed = one(
            Gauge(
                "quill:spec_decode_drafts_allowed",
                "Drafts a request could carry in the last step (0: the cost model says no).",
                labels,
                registry=r,
            )
        )
        self._spec_seen = SpecDecodeStats()
        self.structured_refused = one(
            Counter(
                "quill:structured_refused",
                "Requests refused for a bad constraint (400).",
                labels,
                registry=r,
            )  # fmt: skip
        )
        self.kv_leases = one(
            Gauge("quill:kv_leases", "Prompt KV held for decode instances now.", labels, registry=r)
        )
        self._success = Counter(
            "quill:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=r,
        )
        self._last_token: dict[str, float] = {}
        self.last_stats: StepStats | None = None  # the engine's latest (GET /v1/loads)
        parents += [self._spec_per_position, self._success]
        self.vllm_names = VLLMNamedMetrics(parents, model_name)
        r.register(self.vllm_names)

    def set_cache_config(self, block_size: int, num_blocks: int, prefix_caching: bool,
                         cache_dtype: str) -> None:  # fmt: skip
        """What `vllm:cache_config_info` says of the KV cache."""
        self.vllm_names.cache_config = {
            "block_size": str(block_size),
            "num_gpu_blocks": str(num_blocks),
            "enable_prefix_caching": str(prefix_caching),
            "cache_dtype": cache_dtype,
        }

    def on_step(
        self, outputs: Iterable[RequestOutput], stats: StepStats | None, now: float
    ) -> None:
        """Record one step's outputs, and its stats when it ran a model pass."""
        if stats is not None:
            self._on_stats(stats)
        produced = tokens = 0
        gaps: list[float] = []
        finished: list[RequestOutput] = []
        for out in outputs:
            new = len(out.outputs[0].delta_token_ids)
            if new:
                produced += 1
                tokens += new
                last = self._last_token.get(out.request_id)
                if last is not None:
                    self.itl.observe(now - last)
                    gaps.append(now - last)
                self._last_token[out.request_id] = now
            if out.finished:
                self._last_token.pop(out.request_id, None)
                self._on_finished(out)
                finished.append(out)
        if produced:
            self.batch_size.observe(produced)
        self.console.on_step(stats, now, gaps, tokens, finished)

    def _on_stats(self, stats: StepStats) -> None:
        self.last_stats = stats
        prefix_cache = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        if prefix_cache != self._prefix_seen:
            self.prefix_cache_queries.inc(prefix_cache[0] - self._prefix_seen[0])
            self.prefix_cache_hits.inc(prefix_cache[1] - self._prefix_seen[1])
            self._prefix_seen = prefix_cache
        if stats.num_batched_tokens:  # a model pass ran
            self.iteration_tokens.observe(stats.num_batched_tokens)
        price = stats.price
        if price is not None:
            self.step_predicted.observe(price.predicted_s)
            self.step_measured.observe(price.measured_s)
            self.step_efficiency.observe(price.roofline_efficiency)
            self.mfu.set(price.mfu)
            self.mbu.set(price.mbu)
        if stats.kv_transfer is not None:
            self._on_kv_transfer(stats.kv_transfer)
        if stats.structured is not None:
            for field, counter in self._structured_counters.items():
                new = getattr(stats.structured, field) - getattr(self._structured_seen, field)
                if new:
                    counter.inc(new)
            self._structured_seen = stats.structured
        if stats.spec_decode is not None:
            self._on_spec_decode(stats.spec_decode)
        if stats.num_preemptions:
            self.preemptions.inc(stats.num_preemptions)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)

    def _on_spec_decode(self, totals: SpecDecodeStats) -> None:
        seen = self._spec_seen
        for field, counter in self._spec_counters.items():
            new = getattr(totals, field) - getattr(seen, field)
            if new:
                counter.inc(new)
        before = seen.accepted_per_position
        for i, count in enumerate(totals.accepted_per_position):
            new = count - (before[i] if i < len(before) else 0)
            if new:
                labels = {"model_name": self.model_name, "position": str(i)}
                self._spec_per_position.labels(**labels).inc(new)
        if totals.acceptance_rate is not None:
            self.spec_acceptance.set(totals.acceptance_rate)
        self.spec_allowed.set(totals.drafts_allowed)
        self._spec_seen = totals

    def _on_kv_transfer(self, totals: KVTransferStats) -> None:
        for field, counter in self._kv_counters.items():
            new = getattr(totals, field) - getattr(self._kv_seen, field)
            if new:
                counter.inc(new)
        self.kv_leases.set(totals.leases)
        self._kv_seen = totals

    def _on_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        for hist, value in (
            (self.ttft, m.time_to_first_token),
            (self.e2e, m.e2e_latency),
            (self.queue, m.queue_time),
            (self.prefill, m.prefill_time),
            (self.decode, m.decode_time),
            (self.predicted_ttft, m.predicted_time_to_first_token),
        ):
            if value is not None:
                hist.observe(value)
        self.prompt_len.observe(m.num_prompt_tokens)
        self.gen_len.observe(m.num_generation_tokens)
        self.prompt_tokens.inc(m.num_prompt_tokens)
        self.generation_tokens.inc(m.num_generation_tokens)
        reason = out.outputs[0].finish_reason or "abort"
        self._success.labels(model_name=self.model_name, finished_reason=reason).inc()
