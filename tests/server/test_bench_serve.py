"""`quill bench serve` end to end against the test server, through the command line's own entry
point: every request timed and counted right on each endpoint (completions, chat, responses,
messages), the concurrency cap kept, the JSON and figures written, and failures (a request the
server refuses, a server that is not there) reported with their reasons while the run still
finishes."""

from __future__ import annotations

import json
import socket

import pytest
from server_helpers import API_KEY

from quill.cli import main


def _bench(tmp_path, base_url: str, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "bench.json"
    argv = ["bench", "serve", "--base-url", base_url, "--api-key", API_KEY, "--out", str(out)]
    rc = main(argv + ["--no-progress", *flags])
    return rc, json.loads(out.read_text())


def _most_in_flight(requests: list[dict]) -> int:
    return max(
        sum(1 for other in requests if other["sent"] <= r["sent"] < other["ended"])
        for r in requests
    )


@pytest.mark.parametrize("endpoint", ["completions", "chat", "responses", "messages"])
def test_bench_serve_times_every_request(server, base_url, tmp_path, capsys, endpoint):
    plots = tmp_path / "plots"
    rc, result = _bench(
        tmp_path,
        base_url,
        "--endpoint", endpoint,
        "--num-prompts", "6",
        "--input-len", "32",
        "--output-len", "8",
        "--request-rate", "inf",
        "--max-concurrency", "3",
        "--ignore-eos",
        "--seed", "5",
        *(["--plot", str(plots)] if endpoint == "chat" else []),
    )  # fmt: skip
    assert rc == 0
    summary, requests = result["summary"], result["requests"]
    assert (summary["completed"], summary["failed"]) == (6, 0)
    assert summary["total_output_tokens"] == 48
    assert summary["token_sources"] == {"usage": 6}
    assert len(requests) == 6
    for r in requests:
        assert r["error"] is None and r["status"] == 200
        assert r["output_tokens"] == 8 and r["token_source"] == "usage"
        assert r["ttft"] > 0 and r["e2e"] >= r["ttft"]
        assert 2 <= len(r["chunk_times"]) <= 8  # a chunk may hold back a token's text
        assert len(r["itls"]) == len(r["chunk_times"]) - 1
        assert all(gap >= 0 for gap in r["itls"]) and sum(r["itls"]) > 0
        assert r["chunk_times"][0] - r["sent"] == pytest.approx(r["ttft"])
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / 7)
        if endpoint == "completions":
            assert r["prompt_tokens"] == 32  # the server counts exactly the length asked
        else:
            assert r["prompt_tokens"] > 32  # the chat template wraps the 32 tokens
    assert _most_in_flight(requests) <= 3
    assert summary["ttft_ms"]["count"] == 6 and summary["ttft_ms"]["p50"] > 0
    assert summary["itl_ms"]["count"] == sum(len(r["itls"]) for r in requests)
    assert result["settings"]["seed"] == 5 and result["settings"]["endpoint"] == endpoint
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "TTFT" in table and "no SLO given" in table
    for name in ("ttft_cdf.png", "itl_cdf.png", "timeline.png") if endpoint == "chat" else ():
        assert (plots / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_serve_reports_a_refused_request_and_the_rest(server, base_url, tmp_path, capsys):
    # The second prompt asks for far more tokens than the 8192-token context: a 400.
    dataset = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Hello there", "output_len": 3},
        {"prompt": "Tell me a story", "output_len": 100_000},
        {"prompt": "One, two,", "output_len": 3},
    ]
    dataset.write_text("".join(json.dumps(x) + "\n" for x in lines))
    rc, result = _bench(
        tmp_path, base_url, "--dataset", str(dataset), "--num-prompts", "3", "--ignore-eos",
        "--slo", "e2e=600000",
    )  # fmt: skip
    assert rc == 0
    summary = result["summary"]
    assert (summary["completed"], summary["failed"]) == (2, 1)
    assert summary["good_requests"] == 2  # within a 10-minute e2e objective
    failed = [r for r in result["requests"] if r["error"] is not None]
    assert len(failed) == 1 and failed[0]["status"] == 400 and failed[0]["max_tokens"] == 100_000
    assert failed[0]["error"].startswith("HTTP 400: ")
    assert "maximum context length" in failed[0]["error"]
    assert summary["errors"] == [{"status": 400, "error": failed[0]["error"], "count": 1}]
    assert all(r["output_tokens"] == 3 for r in result["requests"] if r["error"] is None)
    table = capsys.readouterr().out
    assert "1 x HTTP 400: " in table and "Failed requests:" in table


def test_bench_serve_without_a_server_fails_every_request_and_reports(tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rc, result = _bench(
        tmp_path, f"http://127.0.0.1:{port}", "--model", "any", "--num-prompts", "2",
        "--input-len", "4", "--output-len", "2",
    )  # fmt: skip
    assert rc == 1  # nothing succeeded
    assert result["summary"]["failed"] == 2
    for r in result["requests"]:
        assert r["status"] is None and r["error"].startswith("ConnectError")


def test_a_simulator_workload_runs_through_the_same_client(base_url, model_name):
    """quill.bench.client.run_workload (what benchmarks/ compares with the simulator) sends
    each item at its arrival time through quill.bench.runner, and summarize counts every
    token: ignore_eos replies of exactly the asked length, one gap per token after the first."""
    import asyncio
    import random

    from quill.bench.client import random_prompt, run_workload, summarize
    from quill.sim.workload import WorkItem

    items = [WorkItem(f"w{i}", 0.05 * i, 6 + i, 3 + i) for i in range(3)]
    rng = random.Random(0)
    records = asyncio.run(
        run_workload(
            base_url,
            model_name,
            items,
            lambda item: random_prompt(item.prompt_tokens, rng, range(100, 4000)),
            api_key=API_KEY,
            extra_body={"logprobs": 0},
        )
    )
    assert [r.output_tokens for r in records] == [3, 4, 5]
    assert [r.prompt_tokens for r in records] == [6, 7, 8]
    assert all(r.sent >= item.arrival_time for r, item in zip(records, items))
    summary = summarize(records)
    assert summary["num_failed"] == 0 and summary["output_tokens"] == 12
    assert summary["itl_ms"]["count"] == 12 - 3  # every token but each reply's first
    # The server's own TTFT (from its arrival there) rides on the last chunk: the client's,
    # which also holds the way in and out, is longer.
    assert all(0 < r.server_ttft < r.ttft for r in records)
