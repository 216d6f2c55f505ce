"""The benchmark's figures (quill.bench.stats) on small fixtures whose answers are worked out by
hand: percentiles, TPOT, goodput, throughput windows and a whole run's summary."""

from __future__ import annotations

import random

import numpy as np
import pytest

from quill.bench.stats import (
    describe,
    goodput,
    meets_slo,
    percentile,
    summarize_run,
    throughput_windows,
    tpot,
)
from quill.bench.stream import StreamRecord
from quill.sim.metrics import SLO


def test_percentile_interpolates_linearly_between_ranks():
    values = [4.0, 1.0, 3.0, 2.0]  # sorted: 1 2 3 4, n - 1 = 3
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)  # h = 1.5: 2 + 0.5 * (3 - 2)
    assert percentile(values, 90) == pytest.approx(3.7)  # h = 2.7: 3 + 0.7 * (4 - 3)
    assert percentile(values, 99) == pytest.approx(3.97)  # h = 2.97: 3 + 0.97 * (4 - 3)
    assert percentile([10.0, 20.0], 25) == pytest.approx(12.5)  # h = 0.25: 10 + 0.25 * 10
    assert percentile([7.0], 99) == 7.0


def test_percentile_matches_numpy_default_on_random_data():
    # numpy's default method ("linear") is the rule documented; any slip in ranks shows here.
    rng = random.Random(3)
    for n in (1, 2, 5, 101, 1000):
        values = [rng.expovariate(1.0) for _ in range(n)]
        for q in (0, 1, 25, 50, 90, 99, 99.9, 100):
            assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_refuses_nothing_and_out_of_range():
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_describe_in_milliseconds():
    d = describe([0.1, 0.2, 0.4])  # seconds
    assert d["count"] == 3
    assert d["mean"] == pytest.approx(233.3333333)  # 0.7 / 3 s
    assert d["p50"] == pytest.approx(200.0)  # h = 1: the middle value
    assert d["p90"] == pytest.approx(360.0)  # h = 1.8: 0.2 + 0.8 * 0.2 = 0.36 s
    assert d["p99"] == pytest.approx(396.0)  # h = 1.98: 0.2 + 0.98 * 0.2 = 0.396 s
    assert d["max"] == pytest.approx(400.0)
    assert describe([]) == {
        "count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None
    }  # fmt: skip


def test_tpot():
    assert tpot(1.0, 0.2, 5) == pytest.approx(0.2)  # (1.0 - 0.2) / (5 - 1)
    assert tpot(0.9, 0.5, 4) == pytest.approx(0.4 / 3)
    assert tpot(0.5, 0.5, 1) is None  # one token: no gap to average
    assert tpot(0.5, 0.5, 0) is None


def test_meets_slo_every_objective_given():
    slo = SLO.parse("ttft=400,itl=200")  # 0.4 s and 0.2 s
    assert meets_slo(slo, ttft=0.4, request_tpot=0.2, e2e=99.0)  # limits are inclusive
    assert not meets_slo(slo, ttft=0.41, request_tpot=0.1, e2e=1.0)
    assert not meets_slo(slo, ttft=0.1, request_tpot=0.21, e2e=1.0)
    assert meets_slo(slo, ttft=0.1, request_tpot=None, e2e=1.0)  # a one-token reply
    e2e_only = SLO.parse("e2e=600")
    assert meets_slo(e2e_only, ttft=5.0, request_tpot=5.0, e2e=0.6)
    assert not meets_slo(e2e_only, ttft=0.0, request_tpot=0.0, e2e=0.61)


def test_goodput():
    assert goodput(3, 2.0) == 1.5
    assert goodput(0, 2.0) == 0.0
    assert goodput(3, 0.0) is None


def test_throughput_windows():
    events = [(0.1, 1), (0.5, 2), (1.2, 4), (2.0, 1), (2.5, 1), (3.0, 100), (-0.1, 100)]
    # [0, 1): 1 + 2 = 3 per 1 s; [1, 2): 4 per 1 s; [2, 2.5]: 1 + 1 (2.5 is the end, counted)
    # over 0.5 s = 4 per s; 3.0 and -0.1 lie outside.
    assert throughput_windows(events, 0.0, 2.5, 1.0) == pytest.approx([3.0, 4.0, 4.0])
    # Half-second windows over [0, 1]: 1 token in [0, 0.5), 2 in [0.5, 1] -> 2/s and 4/s.
    assert throughput_windows(events, 0.0, 1.0, 0.5) == pytest.approx([2.0, 4.0])
    assert throughput_windows(events, 1.0, 1.0) == []


def _records() -> list[StreamRecord]:
    # r0: text at 0.5, 0.6, 0.8 carrying 1, 1 and 2 tokens; done at 0.9.
    r0 = StreamRecord(0, prompt_len=10, max_tokens=4, scheduled=0.0, sent=0.0, ended=0.9)
    r0.chunk_times, r0.chunk_tokens = [0.5, 0.6, 0.8], [1, 1, 2]
    r0.prompt_tokens, r0.output_tokens, r0.token_source = 10, 4, "usage"
    # r1: sent at 1.0, text at 1.2 and 1.5 (2 tokens, counts per chunk unknown), done at 1.5.
    r1 = StreamRecord(1, prompt_len=8, max_tokens=2, scheduled=1.0, sent=1.0, ended=1.5)
    r1.chunk_times, r1.chunk_tokens = [1.2, 1.5], [None, None]
    r1.output_tokens, r1.token_source = 2, "tokenizer"
    # r2: refused.
    r2 = StreamRecord(2, prompt_len=9, max_tokens=4, scheduled=0.2, sent=0.2, ended=0.3)
    r2.status, r2.error = 400, "HTTP 400: too long"
    return [r0, r1, r2]


def test_summary_of_a_small_run():
    s = summarize_run(_records(), duration=2.0)
    assert (s["num_requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["total_input_tokens"] == 18  # 10 (server's count) + 8 (client's: no usage)
    assert s["total_output_tokens"] == 6
    assert s["request_throughput"] == pytest.approx(1.0)  # 2 / 2 s
    assert s["output_throughput"] == pytest.approx(3.0)  # 6 / 2 s
    assert s["total_token_throughput"] == pytest.approx(12.0)  # (18 + 6) / 2 s
    # 1 s windows: [0, 1) holds r0's 1 + 1 + 2 tokens; [1, 2] r1's 2 spread over its 2 chunks.
    assert s["peak_output_throughput"] == pytest.approx(4.0)
    # TTFT: r0 0.5, r1 0.2 -> mean 0.35; p90 h = 0.9: 0.2 + 0.9 * 0.3 = 0.47.
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert s["ttft_ms"]["p90"] == pytest.approx(470.0)
    assert s["ttft_ms"]["max"] == pytest.approx(500.0)
    # ITL over every gap: r0 0.1 and 0.2, r1 0.3 -> mean 0.2; p99 h = 1.98: 0.2 + 0.98 * 0.1.
    assert s["itl_ms"]["count"] == 3
    assert s["itl_ms"]["mean"] == pytest.approx(200.0)
    assert s["itl_ms"]["p99"] == pytest.approx(298.0)
    # TPOT: r0 (0.9 - 0.5) / 3 = 0.1333.., r1 (0.5 - 0.2) / 1 = 0.3 -> mean 0.21666..
    assert s["tpot_ms"]["mean"] == pytest.approx(216.6666667)
    # e2e: r0 0.9, r1 0.5.
    assert s["e2e_ms"]["mean"] == pytest.approx(700.0)
    assert s["e2e_ms"]["p50"] == pytest.approx(700.0)
    assert s["token_sources"] == {"usage": 1, "tokenizer": 1}
    assert s["errors"] == [{"status": 400, "error": "HTTP 400: too long", "count": 1}]
    assert s["slo"] is None and s["goodput"] is None and s["good_requests"] is None


@pytest.mark.parametrize(
    ("slo", "good"),
    [
        ("ttft=400", 1),  # r0's TTFT of 500 ms misses, r1's 200 ms meets
        ("itl=200", 1),  # r0's TPOT of 133 ms meets, r1's 300 ms misses
        ("ttft=400,itl=200", 0),  # each misses one
        ("e2e=600", 1),  # r1 (500 ms) only
        ("ttft=500,itl=301,e2e=900", 2),  # all met (r1's TPOT is 300 ms, give or take rounding)
    ],
)
def test_goodput_of_a_small_run(slo, good):
    s = summarize_run(_records(), duration=2.0, slo=SLO.parse(slo))
    assert s["good_requests"] == good
    assert s["goodput"] == pytest.approx(good / 2.0)


def test_summary_with_nothing_done():
    records = _records()[2:]
    s = summarize_run(records, duration=0.0)
    assert s["completed"] == 0 and s["request_throughput"] is None
    assert s["ttft_ms"]["count"] == 0 and s["peak_output_throughput"] is None
