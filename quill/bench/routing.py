"""Routing replicas on a shared-prefix workload: the real router and replicas, and the
simulator, policy by policy (benchmarks/bench_routing.py, `quill bench experiments`' routing).

The workload: `tenants` long shared contexts (a system prompt, an agent's history, a few-shot
template), together larger than one replica's KV pool, each request one tenant's context
followed by a short question of its own, arriving as a Poisson process. Prompts are token ids
(completions), so the router and the replicas hash the same tokens and nothing depends on a
chat template. Every policy runs on freshly started replicas (empty caches), each pinned to its
share of the cores, the router in this process; the simulator runs the same items with the
same policy on the stale view a real router has (quill/sim/routing.py).
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from quill.sim.workload import WorkItem


@dataclass
class SharedPrefixWorkload:
    tenants: int = 8
    context: int = 1024  # tokens of each tenant's shared context
    question: int = 48  # tokens of each request's own
    reply: int = 32
    requests: int = 120
    rate: float = 2.0  # requests/s (Poisson)
    seed: int = 0

    def items(self) -> list[WorkItem]:
        rng = random.Random(self.seed)
        t, out = 0.0, []
        for i in range(self.requests):
            t += rng.expovariate(self.rate)
            tenant = rng.randrange(self.tenants)
            out.append(
                WorkItem(
                    f"r{i}",
                    t,
                    self.context + self.question,
                    self.reply,
                    prefix_id=tenant,
                    prefix_tokens=self.context,
                )  # fmt: skip
            )
        return out

    def prompts(self, items: list[WorkItem], vocab: range) -> dict[str, list[int]]:
        """Token ids: each tenant's context drawn once, each question its own."""
        rng = random.Random(self.seed + 1)
        contexts = [[rng.choice(vocab) for _ in range(self.context)] for _ in range(self.tenants)]
        return {
            i.request_id: contexts[i.prefix_id] + [rng.choice(vocab) for _ in range(self.question)]
            for i in items
        }


def replica_prefix_counts(urls: list[str]) -> tuple[float, float]:
    """(prompt tokens looked up, found cached) summed over the replicas' /metrics."""
    queries = hits = 0.0
    for url in urls:
        try:
            text = httpx.get(f"{url}/metrics").text
        except httpx.HTTPError:  # a replica killed on purpose (run_real's kill_at)
            continue
        for family in text_string_to_metric_families(text):
            if family.name == "vllm:prefix_cache_queries":
                queries += sum(s.value for s in family.samples if s.name.endswith("_total"))
            if family.name == "vllm:prefix_cache_hits":
                hits += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return queries, hits


class RouterThread:
    """The router app (`build_router_app(urls, **options)`) on a free port, in a thread of
    this process."""

    def __init__(self, urls: dict[str, list[str]], **options) -> None:
        import uvicorn

        from quill.router.app import build_router_app

        config = uvicorn.Config(
            build_router_app(urls, **options), host="127.0.0.1", port=0, log_level="warning"
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the router did not start")
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.server.servers[0].sockets[0].getsockname()[1]}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def replica_flags(model: str | None, kv_cache_memory: str) -> list[str]:
    """`quill serve` flags of the replicas: unquantized (as the calibration prices them)."""
    flags = ["--served-model-name", "smol", "--kv-cache-memory", kv_cache_memory,
             "--quantization", "none", "--log-level", "warning", "--no-access-log"]  # fmt: skip
    return [model, *flags] if model else flags


def model_and_vocab(model: str | None) -> tuple[str, range]:
    """The model's path (the default model's if None) and the token ids prompts draw from."""
    from pathlib import Path

    from quill.config import EngineConfig
    from quill.frontend.tokenizer import Tokenizer
    from quill.model.factory import model_path_of

    path = str(model_path_of(EngineConfig(model=model)))
    return path, range(100, Tokenizer.load(Path(path)).vocab_size - 100)


def run_real(
    policy: str,
    serve_flags: list[str],
    model: str,
    items,
    prompts,
    log=print,
    kill_at: float | None = None,
) -> dict:
    """Two fresh replicas behind a router of `policy`; the workload through it. `kill_at`:
    SIGKILL the first replica this many seconds into the run (its requests in flight must
    fail at once, the rest finish on the other)."""
    from quill.bench.client import run_workload, summarize
    from quill.router.instances import WHOLE
    from quill.router.local import LocalCluster

    cluster = LocalCluster([WHOLE, WHOLE], serve_flags)
    cluster.start()
    try:
        router = RouterThread({WHOLE: cluster.urls}, policy=policy, model=model)
        url = router.url
        time.sleep(1.0)  # the router's first polls, its subscriptions to the events
        before = replica_prefix_counts(cluster.urls)
        log(f"  {policy}: {len(items)} requests")
        killed: list[float] = []
        if kill_at is not None:

            def kill() -> None:
                time.sleep(kill_at)
                cluster.procs[0].kill()
                killed.append(time.perf_counter() - started)

            threading.Thread(target=kill, daemon=True).start()
        started = time.perf_counter()
        records = asyncio.run(run_workload(url, "smol", items, lambda i: prompts[i.request_id]))
        after = replica_prefix_counts(cluster.urls)
        routed = routed_by_reason(url)
        router.stop()
    finally:
        cluster.stop()
    summary = summarize(records)
    queries, hits = after[0] - before[0], after[1] - before[1]
    extra = {}
    if killed:
        failed = [r for r in records if not r.ok]
        extra = {
            "killed_at_s": killed[0],
            # From the kill to each failed request's end (the run's clock starts a moment
            # after `started`, so the figure errs short by that moment: a few ms).
            "failed_after_kill_s": sorted(r.ended - killed[0] for r in failed if r.ended),
            "ok_after_kill": sum(1 for r in records if r.ok and r.sent > killed[0]),
        }
    return extra | {
        "failed": summary["num_failed"],
        "errors": summary["errors"],
        "ttft_p50_s": _s(summary["ttft_ms"]["p50"]),
        "ttft_p90_s": _s(summary["ttft_ms"]["p90"]),
        "ttft_p99_s": _s(summary["ttft_ms"]["p99"]),
        "itl_p50_s": _s(summary["itl_ms"]["p50"]),
        "output_tokens_per_s": summary["output_throughput"],
        "hit_rate": hits / queries if queries else None,
        "routed": routed,
    }


def simulate(policy: str, config, items) -> dict:
    from quill.sim.cluster import run_colocated

    out = run_colocated(config, items, 2, router=policy)
    r = out["results"]
    return {
        "ttft_p50_s": _s(r["ttft_ms"]["p50"]),
        "ttft_p90_s": _s(r["ttft_ms"]["p90"]),
        "ttft_p99_s": _s(r["ttft_ms"]["p99"]),
        "itl_p50_s": _s(r["itl_ms"]["p50"]),
        "output_tokens_per_s": r["output_throughput"],
        "hit_rate": r["prefix_cache_hit_rate"],
        "routed": out.get("routed"),
    }


def routed_by_reason(url: str) -> dict[str, float]:
    """A quill router's whole requests so far, by why its policy chose (its /metrics)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        if family.name == "quill_router:routed":
            for s in family.samples:
                if s.name.endswith("_total"):
                    out[s.labels["reason"]] = out.get(s.labels["reason"], 0) + s.value
    return out


def _s(ms: float | None) -> float | None:
    return None if ms is None else ms / 1000


POLICIES = ("round-robin", "least-load", "cache-aware")


@dataclass
class Comparison:
    """One experiment: its workload, how the rate is chosen, and the rounds."""

    model: str | None = None  # default: the default model
    kv_cache_memory: str = "128MiB"  # per replica
    rounds: int = 1
    load: float = 1.0  # the rate, as a fraction of `rate_of`'s simulated saturation
    rate_of: str = "round-robin"
    rate: float | None = None  # requests/s, instead of `load`
    calibration_requests: int = 60  # the held-out workload of the serving fit (0: none)
    policies: tuple[str, ...] = POLICIES


def compare(c: Comparison, work: SharedPrefixWorkload, hardware_path, log=print) -> dict:
    """Each policy measured (freshly started replicas, policies in alternating order over the
    rounds) beside the simulator's prediction for the same items, with the simulator's step
    prices fitted again on steps the replicas recorded serving a held-out workload."""
    import tempfile
    from dataclasses import replace
    from pathlib import Path

    from quill.cost.hardware import HardwareSpec
    from quill.cost.refit import calibrated_model, recorded_steps, refit_spec
    from quill.engine_args import parse_bytes
    from quill.sim.config import SimConfig

    model_path, vocab = model_and_vocab(c.model)
    hardware = HardwareSpec.resolve(str(hardware_path))
    spec = calibrated_model(hardware, model_path)

    def sim_config(hw: HardwareSpec) -> SimConfig:
        return SimConfig.create(spec, hw, max_num_seqs=256, max_num_batched_tokens=512,
                                kv_cache_memory=parse_bytes(c.kv_cache_memory),
                                context_len=8192)  # fmt: skip

    flags = replica_flags(c.model, c.kv_cache_memory)
    config, fit = sim_config(hardware), None
    if c.calibration_requests:
        # A replica shares its core with its API process, which the calibration (the engine
        # alone) did not: fit again on steps recorded while serving other tenants' requests.
        held_out = replace(work, requests=c.calibration_requests, rate=2.0, seed=work.seed + 100)
        cal_items = held_out.items()
        steps_file = Path(tempfile.mkdtemp(prefix="quill-routing-")) / "steps.jsonl"
        log(f"routing: serving fit, {len(cal_items)} held-out requests, steps recorded")
        run_real("round-robin", flags + ["--record-steps", str(steps_file)], model_path,
                 cal_items, held_out.prompts(cal_items, vocab), log)  # fmt: skip
        steps = [s for i in (0, 1) for s in recorded_steps(f"{steps_file}.{i}")]
        fitted = refit_spec(hardware, spec, steps)
        config = sim_config(fitted)
        fit = {"steps": len(steps), "error": (fitted.calibration or {}).get("fit_error")}
    if c.rate is not None:
        work = replace(work, rate=c.rate)
    else:
        burst = replace(work, rate=float("inf"))
        top = simulate(c.rate_of, config, burst.items())
        work = replace(work, rate=c.load * top["output_tokens_per_s"] / work.reply)
        log(f"routing: {work.rate:.3g} requests/s ({c.load:g} x {c.rate_of}'s simulated "
            "saturation)")  # fmt: skip
    items = work.items()
    prompts = work.prompts(items, vocab)
    measured: dict[str, list] = {name: [] for name in c.policies}
    for k in range(c.rounds):
        for policy in c.policies if k % 2 == 0 else c.policies[::-1]:
            result = run_real(policy, flags, model_path, items, prompts, log)
            r = result
            log(f"routing: {policy}: TTFT p90 {r['ttft_p90_s']:.3g} s, "
                f"{r['output_tokens_per_s']:.3g} tokens/s, "
                f"hit rate {r['hit_rate']:.3g}")  # fmt: skip
            measured[policy].append(result)
    return {
        "serving_fit": fit,
        "workload": vars(work)
        | {
            "pool_tokens_per_replica": config.num_blocks * config.block_size,
            "contexts_tokens": work.tenants * work.context,
        },  # fmt: skip
        "measured": measured,
        "simulated": {name: simulate(name, config, items) for name in c.policies},
        "hardware_file": str(hardware_path),
        "kv_cache_memory": c.kv_cache_memory,
    }
