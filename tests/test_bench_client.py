"""The benchmark client's token counting: one logprob entry per token (quill, vLLM, OpenAI),
or llama-server's running count, so either server's stream is timed token by token."""

from __future__ import annotations

from quill.bench.client import count_new_tokens


def test_counts_logprob_entries_per_chunk():
    chunk = {"choices": [{"text": "ab", "logprobs": {"tokens": ["a", "b"]}}]}
    assert count_new_tokens(chunk, counted=5) == 2
    assert count_new_tokens({"choices": [{"text": "", "logprobs": None}]}, counted=0) == 0
    assert count_new_tokens({"choices": [], "usage": {"completion_tokens": 9}}, counted=9) == 0


def test_counts_llama_server_running_total():
    # llama-server sends no logprobs by default; its timings carry the tokens predicted so far.
    assert count_new_tokens({"choices": [{}], "timings": {"predicted_n": 7}}, counted=5) == 2
    assert count_new_tokens({"timings": {"predicted_n": 3}}, counted=3) == 0
