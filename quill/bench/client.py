"""The simulator's workloads sent to a server, and the per-token summary the scripts compare.

`run_workload` sends each of a workload's items (the simulator's `WorkItem`s: arrival time,
prompt and reply lengths) at its arrival time through the one load client (quill.bench.runner
and quill.bench.stream: open loop, every chunk timestamped, failures kept with their reasons);
`summarize` gives TTFT, the gap before every token, end-to-end latency and throughput, the
figures benchmarks/ sets beside the simulator's and the peers'. `quill bench serve`
(quill.bench.serve) is the full benchmark on the same client.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from quill.bench.datasets import BenchRequest
from quill.bench.runner import Target, run_requests
from quill.bench.stream import StreamRecord
from quill.sim.metrics import Distribution
from quill.sim.workload import WorkItem


def random_prompt(num_tokens: int, rng: random.Random, vocab: Sequence[int]) -> list[int]:
    """Token ids drawn at random, so no two prompts share a prefix a cache could reuse."""
    return [rng.choice(vocab) for _ in range(num_tokens)]


async def run_workload(
    base_url: str,
    model: str,
    items: Sequence[WorkItem],
    make_prompt: Callable[[WorkItem], list[int] | str],
    api_key: str | None = None,
    timeout: float = 600.0,
    extra_body: dict | None = None,
) -> list[StreamRecord]:
    """Send every item at its arrival time (seconds from now), greedy, exactly its reply length
    (ignore_eos); returns one record per item (quill.bench.runner does the sending)."""
    target = Target(base_url, model, api_key=api_key, ignore_eos=True, timeout=timeout,
                    extra_body=extra_body)  # fmt: skip
    requests = [BenchRequest(make_prompt(i), i.prompt_tokens, i.output_tokens) for i in items]
    records, _ = await run_requests(target, requests, [i.arrival_time for i in items])
    return records


def token_gaps(record: StreamRecord) -> list[float]:
    """The gap before every token after the first: a chunk that brought k tokens gives its gap
    to the token it starts with and 0 to the k - 1 others (they arrived with it)."""
    gaps = []
    times, counts = record.chunk_times, record.chunk_tokens
    for k in range(len(times)):
        n = counts[k] if k < len(counts) and counts[k] else 1
        if k:
            gaps.append(times[k] - times[k - 1])
        gaps.extend([0.0] * (n - 1))
    return gaps


def summarize(records: Sequence[StreamRecord]) -> dict:
    """TTFT, inter-token latency (over all gaps), end-to-end latency in ms, and throughput."""
    ttft, itl, e2e = Distribution(), Distribution(), Distribution()
    ok = [r for r in records if r.ok]
    for r in ok:
        ttft.add(r.ttft)
        e2e.add(r.e2e)
        for gap in token_gaps(r):
            itl.add(gap)
    if ok:
        duration = max(r.ended for r in ok) - min(r.sent for r in ok)
    else:
        duration = 0.0
    output = sum(r.output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "duration_s": duration,
        "output_tokens": output,
        "request_throughput": len(ok) / duration if duration else None,
        "output_throughput": output / duration if duration else None,
        "ttft_ms": ttft.summary(1000),
        "itl_ms": itl.summary(1000),
        "e2e_ms": e2e.summary(1000),
    }
