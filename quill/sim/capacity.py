"""How much traffic one replica sustains within a latency objective, and how many replicas a
target rate needs.

Each trial is a whole simulation at one request rate with the same seed, so trials differ only
in pace (see `workload.synthetic`). The search assumes that latency does not fall as the rate
rises: it brackets the answer by doubling or halving, then bisects (geometrically) until the
highest passing rate and the lowest failing one are within the tolerance of each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from quill.sim.metrics import SLO

MIN_RATE = 1e-3  # requests/s; below this the objective is called unreachable
MAX_RATE = 1e7


def meets(slo: SLO, results: dict) -> bool:
    """p99 TTFT, p99 ITL (over all gaps) and, if asked, p99 end-to-end latency within the SLO,
    with every request served in full."""
    return results["num_truncated"] == 0 and slo.meets_percentile(results, 99)


def find_capacity(
    run_at: Callable[[float], dict],
    slo: SLO,
    tolerance: float = 0.02,
    on_trial: Callable[[dict], None] | None = None,
) -> dict:
    """The highest rate whose run meets `slo`, within relative `tolerance` of the lowest rate
    seen to fail. `run_at(rate)` returns a simulation's output ({"results": ...}); an infinite
    rate is run first, and its throughput is where the search starts."""
    if not (0 < tolerance < 1):
        raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
    trials: list[dict] = []

    def trial(rate: float) -> bool:
        results = run_at(rate)["results"]
        entry = {
            "rate": rate,
            "meets_slo": meets(slo, results),
            "ttft_p99_ms": results["ttft_ms"]["p99"],
            "itl_p99_ms": results["itl_ms"]["p99"],
            "e2e_p99_ms": results["e2e_ms"]["p99"],
            "request_throughput": results["request_throughput"],
        }
        trials.append(entry)
        if on_trial is not None:
            on_trial(entry)
        return entry["meets_slo"]

    if trial(math.inf):  # met even when every request arrives at once: no rate is too high
        return _found(math.inf, None, tolerance, trials)
    saturated = trials[0]["request_throughput"] or 1.0
    passing, failing = None, None
    rate = saturated
    if trial(rate):
        passing = rate
        while failing is None:
            rate *= 2
            if rate > MAX_RATE:
                raise ValueError(f"the SLO is still met at {MAX_RATE:g} requests/s")
            if trial(rate):
                passing = rate
            else:
                failing = rate
    else:
        failing = rate
        while passing is None:
            rate /= 2
            if rate < MIN_RATE:
                break
            if trial(rate):
                passing = rate
            else:
                failing = rate
    if passing is not None:
        while failing / passing > 1 + tolerance:
            mid = math.sqrt(passing * failing)
            if trial(mid):
                passing = mid
            else:
                failing = mid
    return _found(passing or 0.0, failing, tolerance, trials)


def _found(rate: float, failing: float | None, tolerance: float, trials: list[dict]) -> dict:
    return {
        "capacity_rate": rate,
        "lowest_failing_rate": failing,
        "tolerance": tolerance,
        "saturated_throughput": trials[0]["request_throughput"],
        "trials": trials,
    }


def replicas_needed(target_rate: float, capacity_rate: float) -> int:
    """Replicas for `target_rate`, assuming it splits evenly over independent replicas that
    each sustain `capacity_rate`."""
    if not capacity_rate > 0:
        raise ValueError("the SLO is not met at any rate, so no number of replicas suffices")
    if math.isinf(capacity_rate):
        return 1
    return max(1, math.ceil(target_rate / capacity_rate * (1 - 1e-12)))
