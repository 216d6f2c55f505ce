"""GET /console/state, the JSON the console page reads: counts that match what the openai
client was told, TTFT and ITL kept apart, steps priced, the API key required."""

from __future__ import annotations

import httpx
import numpy as np

from quill.server.console import BUCKETS, distribution, percentile


def test_percentiles_and_histogram_match_numpy():
    rng = np.random.default_rng(3)
    values = list(rng.exponential(0.05, 101))
    for q in (50, 90, 99):
        assert abs(percentile(sorted(values), q) - np.percentile(values, q)) < 1e-12
    d = distribution(values)
    expected, _ = np.histogram(values, bins=[0.0, *BUCKETS, np.inf])
    # numpy's bins are closed on the left, ours on the right: no value sits on an edge here.
    assert d["histogram"] == expected.tolist() and d["count"] == 101
    assert distribution([])["p50"] is None


def test_the_state_counts_the_requests_the_client_made(client, http, model_name, base_url):
    before = http.get("/console/state").json()
    usages = []
    for i, n in enumerate((3, 7, 12)):
        r = client.completions.create(
            model=model_name, prompt=f"Count to {i}:", max_tokens=n, temperature=0
        )
        usages.append(r.usage)
    state = http.get("/console/state").json()
    assert state["finished_requests"] == before["finished_requests"] + 3
    newest = state["requests"][:3][::-1]  # newest first
    for row, usage in zip(newest, usages, strict=True):
        assert row["prompt_tokens"] == usage.prompt_tokens
        assert row["output_tokens"] == usage.completion_tokens
        assert row["ttft_s"] > 0 and row["finished_at"] <= 0
        assert row["flops"] > 0 and row["cost_usd"] > 0  # the hardware file has a price
    assert state["ttft"]["count"] >= 3
    # ITL: one gap per token after each reply's first (n - 1 each), in the last minute.
    assert state["itl"]["count"] >= (3 - 1) + (7 - 1) + (12 - 1)
    assert state["running"] == 0 and state["waiting"] == 0
    assert state["output_tokens_per_s"] > 0
    priced = [s for s in state["steps"] if s["predicted_s"] is not None]
    assert priced and all(s["measured_s"] > 0 for s in priced)
    assert any(s["prefill_tokens"] for s in priced) and any(s["decode_tokens"] for s in priced)
    assert httpx.get(f"{base_url}/console/state").status_code == 401
