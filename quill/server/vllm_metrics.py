"""quill's metrics again under vLLM's names, for the routers and dashboards that read those.

The Gateway API Inference Extension's model-server protocol (llm-d's scheduler), vLLM's
production stack, Dynamo's planner and the Grafana boards people already have read
`vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc` and the rest. Each is the quill metric
of the same meaning, exposed a second time at every scrape (one count, two names: they never
drift apart), plus `vllm:cache_config_info`. Where the meaning is not quite vLLM's it says so:

- `vllm:prompt_tokens` / `vllm:generation_tokens` count a request's tokens when it finishes
  (vLLM counts them as they are computed), so a long request shows up at its end;
- `vllm:kv_cache_usage_perc` counts blocks in some request's table (cached blocks free for
  reuse count as free), as vLLM's does;
- `vllm:gpu_cache_usage_perc`, the name before vLLM 0.10, is the same gauge.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily, Metric

# quill's metric (without its `quill:` prefix) -> vLLM's names for it.
VLLM_NAMES = {
    "num_requests_running": ("num_requests_running",),
    "num_requests_waiting": ("num_requests_waiting",),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "prefix_cache_queries": ("prefix_cache_queries",),
    "prefix_cache_hits": ("prefix_cache_hits",),
    "num_preemptions": ("num_preemptions",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "request_success": ("request_success",),
    "time_to_first_token_seconds": ("time_to_first_token_seconds",),
    "inter_token_latency_seconds": ("inter_token_latency_seconds",),
    "e2e_request_latency_seconds": ("e2e_request_latency_seconds",),
    "request_queue_time_seconds": ("request_queue_time_seconds",),
    "request_prefill_time_seconds": ("request_prefill_time_seconds",),
    "request_decode_time_seconds": ("request_decode_time_seconds",),
    "iteration_tokens_total": ("iteration_tokens_total",),
    "request_prompt_tokens": ("request_prompt_tokens",),
    "request_generation_tokens": ("request_generation_tokens",),
    "spec_decode_num_drafts": ("spec_decode_num_drafts",),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_decode_num_accepted_tokens": ("spec_decode_num_accepted_tokens",),
    "spec_decode_num_accepted_tokens_per_pos": ("spec_decode_num_accepted_tokens_per_pos",),
}


class VLLMNamedMetrics:
    """A collector: the listed quill metrics (their parents, all label values) renamed."""

    def __init__(self, metrics: list, model_name: str) -> None:
        self._metrics = [m for m in metrics if _bare(m._name) in VLLM_NAMES]
        self._model_name = model_name
        self.cache_config: dict[str, str] | None = None

    def collect(self):
        for metric in self._metrics:
            for family in metric.collect():
                for name in VLLM_NAMES[_bare(family.name)]:
                    yield _renamed(family, f"vllm:{name}")
        if self.cache_config is not None:
            info = GaugeMetricFamily(
                "vllm:cache_config_info",
                "The KV cache's configuration (labels; the value is 1).",
                labels=list(self.cache_config),
            )
            info.add_metric(list(self.cache_config.values()), 1.0)
            yield info


def _bare(name: str) -> str:
    return name.removeprefix("quill:")


def _renamed(family, name: str):
    old = family.name
    copy = Metric(name, family.documentation, family.type, family.unit)
    copy.samples = [s._replace(name=name + s.name[len(old) :]) for s in family.samples]
    return copy
