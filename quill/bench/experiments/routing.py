"""Experiment 7, routing: two replicas on a shared-prefix workload, round-robin against
least-load against cache-aware, measured beside the simulator's prediction.

Each replica is pinned to one core with a KV pool smaller than the tenants' shared contexts
together, so a router that scatters a tenant's requests makes every replica hold every
context and evict them in turn, while one that keeps a tenant on one replica lets the two
pools hold half the contexts each. The workload and the runs are quill/bench/routing.py's
(also `benchmarks/bench_routing.py`); the simulator runs the same items with the same policy
objects, on the stale view a real router has.
"""

from __future__ import annotations

from quill.bench.experiments.report import Section, Table, num, pct, seconds
from quill.bench.experiments.stats import median, relative_error

NAME = "routing"
TITLE = "Routing: round-robin, least-load and cache-aware on shared prefixes"
KEYS = ("ttft_p50_s", "ttft_p90_s", "output_tokens_per_s", "hit_rate")


def needs(ctx):
    return None  # the replicas load their own engines


def run(ctx) -> dict:
    from quill.bench.experiments.split import one_core_hardware
    from quill.bench.routing import Comparison, SharedPrefixWorkload, compare

    ctx.release_engine()  # two replicas need the cores and the memory
    quick = ctx.settings.quick
    work = SharedPrefixWorkload(tenants=8, context=1024, question=48, reply=32,
                                requests=40 if quick else 120, seed=ctx.settings.seed)  # fmt: skip
    comparison = Comparison(model=ctx.settings.model, rounds=1 if quick else 2,
                            calibration_requests=20 if quick else 60)  # fmt: skip
    return compare(comparison, work, one_core_hardware(), ctx.log)


def measured_medians(result: dict) -> dict[str, dict]:
    return {
        name: {k: median([r[k] for r in runs if r[k] is not None]) for k in KEYS}
        for name, runs in result["measured"].items()
    }


def describe(result: dict) -> Section:
    w, sim = result["workload"], result["simulated"]
    real = measured_medians(result)

    def cell(name: str, key: str, show) -> str:
        m, s = real[name][key], sim[name][key]
        return f"{show(m)} / {show(s)} ({pct(relative_error(s, m))})"

    def share(x) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    table = Table(
        ["policy", "TTFT p50: measured / simulated", "TTFT p90", "output tok/s", "hit rate"],
        [
            [
                name,
                cell(name, "ttft_p50_s", seconds),
                cell(name, "ttft_p90_s", seconds),
                cell(name, "output_tokens_per_s", num),
                cell(name, "hit_rate", share),
            ]
            for name in real
        ],  # fmt: skip
        f"{w['requests']} requests at {num(w['rate'])}/s (Poisson), each one of {w['tenants']} "
        f"tenants' {w['context']}-token contexts (uniformly at random) and a {w['question']}-"
        f"token question of its own, {w['reply']}-token replies; two replicas, one core each, "
        f"{result['kv_cache_memory']} of KV each ({w['pool_tokens_per_replica']} tokens; the "
        f"contexts together: {w['contexts_tokens']}). Measured: the median of "
        f"{len(next(iter(result['measured'].values())))} runs per policy on fresh replicas, "
        "policies in alternating order. Hit rate: prompt tokens found cached / looked up.",
    )
    rr, ca = real.get("round-robin"), real.get("cache-aware")
    reading = ""
    if rr and ca:
        reading = (
            f"Cache-aware against round-robin: TTFT p90 {seconds(ca['ttft_p90_s'])} against "
            f"{seconds(rr['ttft_p90_s'])} ({ca['ttft_p90_s'] / rr['ttft_p90_s']:.2f}x), output "
            f"{num(ca['output_tokens_per_s'])} against {num(rr['output_tokens_per_s'])} "
            f"tokens/s ({ca['output_tokens_per_s'] / rr['output_tokens_per_s']:.2f}x), hit rate "
            f"{share(ca['hit_rate'])} against {share(rr['hit_rate'])}."
        )
    errors = [
        abs(relative_error(sim[n][k], real[n][k]))
        for n in real
        for k in ("ttft_p50_s", "ttft_p90_s", "hit_rate")
        if relative_error(sim[n][k], real[n][k]) is not None
    ]
    if errors:
        reading += (
            f" The simulator's error on TTFT p50 / p90 and hit rate: at most "
            f"{pct(max(errors), False)}, median {pct(sorted(errors)[len(errors) // 2], False)}."
        )
    what = (
        "Two replicas behind `quill router` on a workload of shared prefixes larger than one "
        "replica's KV, near saturation: what routing by cached prefix buys against routing by "
        "turn or by load, and whether the simulator predicts it."
    )
    caption = "TTFT p50 and p90 and output tokens/s per policy: measured (bars) and simulated (x)."
    return Section(NAME, TITLE, what, [table], f"{NAME}.png", caption, reading)
