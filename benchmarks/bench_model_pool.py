"""Several models behind one server: memory under the budget, the first request's wait, and a
loaded model's pace while another loads.

Why: a workstation keeps a chat model, a coder and an embedder and uses whichever a tool asks
for (issue 48). Targets: memory never above `--models-memory` (sampled through a run that
alternates three models under a budget that holds two), every request answered; the first
request to an unloaded model waits no more than its load time plus 1 s; a loaded model's
tokens/s while another loads within 10% of serving it alone, beyond the cores the load takes.

One `quill serve --model ...` (three models: the default SmolLM2-135M, Gemma 3 270M Q4_K_M,
Llama-3.2-1B's shape in Q4_K_M) as a subprocess. The engines' memory: every process under the
server but the server itself, summed, every 50 ms. Phase 1: Ollama `generate` requests (raw,
16 tokens) alternating the three models, twice round; each request's wait for its model
(Ollama's `load_duration`) against the model's load time (the front's
`quill:model_load_seconds`). Phase 2: the first model streaming 128 tokens alone, then while
the third one loads (its first request sent just before), alternating.

    .venv/bin/python benchmarks/bench_model_pool.py [--budget 4.2GiB] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_server import start_server  # noqa: E402
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill.engine_args import parse_bytes  # noqa: E402
from quill.model.default_model import default_model_dir  # noqa: E402
from quill.model.named_models import named_model_path  # noqa: E402
from quill.server.models.memory import process_tree_rss  # noqa: E402

LLAMA = Path.home() / ".cache/quill/peers/models/real/llama-3.2-1b/llama-3.2-1b-Q4_K_M.gguf"


class Sampler(threading.Thread):
    """The engines' resident memory: the server's process tree without the server itself."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.stop = pid, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            own = process_tree_rss(self.pid) - _own_rss(self.pid)
            self.samples.append(own)
            time.sleep(0.05)


def _own_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def load_seconds(http: httpx.Client) -> dict[str, float]:
    out = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("quill:model_load_seconds{"):
            name = line.split('model_name="')[1].split('"')[0]
            out[name] = float(line.rsplit(" ", 1)[1])
    return out


def generate(http: httpx.Client, model: str, tokens: int) -> dict:
    started = time.perf_counter()
    options = {"num_predict": tokens, "temperature": 0}
    body = {"model": model, "prompt": "Once upon a time", "raw": True, "stream": False,
            "options": options}  # fmt: skip
    r = http.post("/api/generate", json=body)
    r.raise_for_status()
    return {**r.json(), "client_s": time.perf_counter() - started}


def stream_rate(http: httpx.Client, model: str, tokens: int) -> float:
    """Tokens/s of one streamed reply, from its first token to its last."""
    times = []
    body = {"model": model, "prompt": "Once upon a time", "raw": True,
            "options": {"num_predict": tokens, "temperature": 0}}  # fmt: skip
    with http.stream("POST", "/api/generate", json=body) as r:
        for line in r.iter_lines():
            if line and not json.loads(line)["done"]:
                times.append(time.perf_counter())
    return (len(times) - 1) / (times[-1] - times[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", default="4.2GiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    budget = parse_bytes(args.budget)
    models = {"smol": default_model_dir(), "gemma": named_model_path("gemma3-270m"),
              "llama": LLAMA}  # fmt: skip
    flags = [f"--model={n}={p}" for n, p in models.items()]
    proc, url = start_server("auto", [*flags, "--models-memory", args.budget,
                                      "--max-loaded-models", "3"])  # fmt: skip
    sampler = Sampler(proc.pid)
    sampler.start()
    results: dict = {"requests": [], "interference": []}
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            for _ in range(args.rounds):
                for name in models:
                    out = generate(http, name, 16)
                    loads = load_seconds(http)
                    row = {"model": name, "client_s": out["client_s"],
                           "load_duration_s": out["load_duration"] / 1e9,
                           "load_s": loads.get(name) if out["load_duration"] else None,
                           "eval_count": out["eval_count"]}  # fmt: skip
                    results["requests"].append(row)
                    print(row, flush=True)
            # Phase 2: smol alone, then smol while llama loads (llama unloaded first).
            http.post("/api/generate", json={"model": "llama", "prompt": "", "keep_alive": 0})
            generate(http, "smol", 4)
            for r in range(args.rounds * 2):
                for side in ("alone", "loading") if r % 2 == 0 else ("loading", "alone"):
                    if side == "loading":
                        http.post("/api/generate", json={"model": "llama", "prompt": "",
                                                         "keep_alive": 0})  # fmt: skip
                        loader = threading.Thread(target=generate, args=(http, "llama", 1))
                        loader.start()
                        time.sleep(0.5)  # the load under way
                        rate = stream_rate(http, "smol", 128)
                        loader.join()
                    else:
                        rate = stream_rate(http, "smol", 128)
                    results["interference"].append({"side": side, "tokens_per_s": rate})
                    print(side, f"{rate:.1f} tokens/s", flush=True)
    finally:
        sampler.stop.set()
        sampler.join()
        proc.terminate()
        proc.wait(60)
    # The reference "beyond the cores the load takes": the same model served alone on the
    # half of the cores a load leaves it (its engine's threads counted from its affinity).
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus[: max(1, len(cpus) // 2)])
    try:
        proc, url = start_server("auto", [str(models["smol"])])
    finally:
        os.sched_setaffinity(0, cpus)
    try:
        with httpx.Client(base_url=url, timeout=600) as http:
            generate(http, http.get("/v1/models").json()["data"][0]["id"], 4)
            name = http.get("/v1/models").json()["data"][0]["id"]
            half = max(stream_rate(http, name, 128) for _ in range(args.rounds * 2))
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"smol alone on {max(1, len(cpus) // 2)} of {len(cpus)} cores: {half:.1f} tokens/s")
    peak = max(sampler.samples)
    waits = [r["load_duration_s"] - r["load_s"] for r in results["requests"] if r["load_s"]]
    alone = max(x["tokens_per_s"] for x in results["interference"] if x["side"] == "alone")
    loading = max(x["tokens_per_s"] for x in results["interference"] if x["side"] == "loading")
    summary = {"machine": machine_info(os.cpu_count() or 1), "date": time.strftime("%Y-%m-%d"),
               "command": " ".join(sys.argv), "budget_bytes": budget, "peak_bytes": peak,
               "wait_beyond_load_s_max": max(waits) if waits else None,
               "tokens_per_s_alone": alone, "tokens_per_s_while_loading": loading,
               "tokens_per_s_alone_on_the_cores_a_load_leaves": half,
               **results}  # fmt: skip
    print(f"peak {peak / (1 << 30):.2f} GiB of a {budget / (1 << 30):.2f} GiB budget; "
          f"wait beyond the load at most {summary['wait_beyond_load_s_max']:.2f} s; "
          f"smol {alone:.1f} tokens/s alone, {loading:.1f} while a model loads "
          f"({loading / alone:.2f}x; {loading / half:.2f}x its pace alone on the cores the "
          f"load leaves it)")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
