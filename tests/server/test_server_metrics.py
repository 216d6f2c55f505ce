"""/metrics: Prometheus text that parses, vLLM's names, and counters that add up."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families
from server_helpers import sample

HISTOGRAMS = [
    "time_to_first_token_seconds",
    "inter_token_latency_seconds",
    "e2e_request_latency_seconds",
    "request_queue_time_seconds",
    "request_prefill_time_seconds",
    "request_decode_time_seconds",
    "iteration_tokens_total",
]


def test_metric_names_and_types(http):
    r = http.get("/metrics")
    assert r.headers["content-type"].startswith("text/plain")
    families = {f.name: f.type for f in text_string_to_metric_families(r.text)}
    for name in HISTOGRAMS:
        assert families[f"quill:{name}"] == "histogram", name
    for name in ("step_predicted_seconds", "step_measured_seconds", "step_roofline_efficiency"):
        assert families[f"quill:{name}"] == "histogram", name
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "model_flops_utilization",
        "model_bandwidth_utilization",
    ):
        assert families[f"quill:{name}"] == "gauge", name
    for name in ("num_preemptions", "prompt_tokens", "generation_tokens", "request_success"):
        assert families[f"quill:{name}"] == "counter", name


def test_counters_rise_by_known_amounts(client, scrape, model_name):
    before = scrape()
    comp = client.completions.create(
        model=model_name,
        prompt="One, two, three,",
        max_tokens=5,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chat = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Say hi"}],
        n=2,
        max_tokens=4,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    after = scrape()

    def rise(name: str, **labels) -> float:
        return sample(after, name, **labels) - sample(before, name, **labels)

    # The chat request's prompt is counted once in usage but runs as two engine requests.
    prompt_tokens = comp.usage.prompt_tokens + 2 * chat.usage.prompt_tokens
    assert comp.usage.completion_tokens == 5 and chat.usage.completion_tokens == 8
    assert rise("quill:prompt_tokens_total") == prompt_tokens
    assert rise("quill:generation_tokens_total") == 13
    assert rise("quill:request_success_total", finished_reason="length") == 3
    assert rise("quill:request_success_total", finished_reason="stop") == 0
    for name in HISTOGRAMS[:6]:
        if name != "inter_token_latency_seconds":
            assert rise(f"quill:{name}_count") == 3, name
    assert rise("quill:inter_token_latency_seconds_count") == 4 + 3 + 3  # tokens - 1 each
    assert (
        rise("quill:e2e_request_latency_seconds_sum")
        >= (comp.model_extra["metrics"]["e2e_latency"])
    )
    # Every prompt token is computed once, except those the prefix cache held (the n = 2 chat
    # choices share their prompt's blocks); each reply's tokens after the first are decodes.
    hits = rise("quill:prefix_cache_hits_total")
    assert rise("quill:prefix_cache_queries_total") == prompt_tokens
    block = 16
    assert hits >= (chat.usage.prompt_tokens - 1) // block * block  # the second chat choice
    assert rise("quill:iteration_tokens_total_sum") == prompt_tokens - hits + 4 + 3 + 3
    assert (
        comp.usage.prompt_tokens_details.cached_tokens
        == comp.model_extra["metrics"]["num_cached_tokens"]
    )
    assert sample(after, "quill:num_requests_running") == 0


def test_steps_priced_beside_their_measured_time(client, scrape, model_name):
    before = scrape()
    comp = client.completions.create(
        model=model_name, prompt="Count: 1, 2,", max_tokens=4, temperature=0
    )
    after = scrape()
    steps = sample(after, "quill:step_measured_seconds_count") - sample(
        before, "quill:step_measured_seconds_count"
    )
    assert steps >= comp.usage.completion_tokens  # one step per token at least
    for name in ("step_predicted_seconds", "step_roofline_efficiency"):
        rise = sample(after, f"quill:{name}_count") - sample(before, f"quill:{name}_count")
        assert rise == steps, name
    # Each step's floor is below its measured time on a spec this modest, so 0 < efficiency.
    assert 0 < sample(after, "quill:model_bandwidth_utilization")
    assert 0 < sample(after, "quill:model_flops_utilization")
    metrics = comp.model_extra["metrics"]
    assert metrics["flops"] > 0 and metrics["bytes_moved"] > 0
    # $36/h is 1 cent a second: the request paid for at most every second it was in a step.
    assert 0 < metrics["cost_usd"] <= 0.01 * metrics["e2e_latency"]
