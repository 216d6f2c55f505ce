"""Server benchmark: `quill serve` under N streaming clients against the offline engine at the
same concurrency, in one run; and the API process's core (shared, or one of its own) compared.

Why: the server must not cost the engine its pace. Targets (issue 18): at 1, 4, 16 and 64
streams the server keeps at least 90% of the offline engine's output tokens/s, and at one stream
its median inter-token gap is within 10% of the offline engine's median decode step.

Both sides run the same requests (random prompt token ids, greedy, ignore_eos, a fixed length)
with the engine's defaults (as `quill serve` and `LLM()` start). The offline engine keeps N
requests in flight and steps; each server variant runs as a real subprocess (`--api-core
shared` and `--api-core own`) and N asyncio clients, in this process, each stream their requests
one after another over one keep-alive connection, timestamping every chunk (one token each).
A third offline side, "bare", runs with the step observers off (`--no-predict-ttft
--no-cost-accounting`): its ratio to "offline" is what the observers cost a step (`--no-bare`
leaves it out). At each level the sides take turns round after round, each keeping its best
round.

`--console` (issue 23) instead runs one server three ways a round, alternating: the console
closed; "polled" (its JSON fetched at the page's pace by a thread here: the server's share);
and open in headless chromium (benchmarks/console_browser.py, on this same machine, so the
browser's own CPU counts too). It reports tokens/s and ITL against closed, the page's time to
its first draw and how often it redrew while the traffic ran. Usage:

    .venv/bin/python benchmarks/bench_server.py [--levels 1,4,16,64] [--max-tokens 64]
        [--prompt-tokens 32] [--rounds 2] [--api-cores shared,own] [--no-bare]
        [--console] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.engine.machine import machine_info  # noqa: E402
from quill import LLM, SamplingParams  # noqa: E402


def prompt_ids(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=gen).tolist()


def run_offline(llm: LLM, clients: int, prompts: list[list[int]], max_tokens: int) -> dict:
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    pending = list(prompts)
    in_flight, tokens = 0, 0
    decode_steps: list[float] = []
    start = time.perf_counter()
    while pending or in_flight:
        while pending and in_flight < clients:  # same concurrency as the server's clients
            engine.add_request(pending.pop(0), params)
            in_flight += 1
        outputs, stats = engine.step_with_stats()
        if stats is not None and stats.num_prefill_tokens == 0:
            decode_steps.append(stats.duration)
        for out in outputs:
            if out.finished:
                in_flight -= 1
                tokens += len(out.outputs[0].token_ids)
    wall = time.perf_counter() - start
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "decode_step_p50_ms": 1000 * statistics.median(decode_steps) if decode_steps else None,
    }


def start_server(api_core: str, extra: list[str] | None = None) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable, "-m", "quill.cli", "serve", "--port", "0", "--no-access-log",
        "--log-level", "warning", "--api-core", api_core, *(extra or []),
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "QUILL_API_KEY"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    url = None
    for line in proc.stdout:
        if m := re.search(r"(http://[\w.]+:\d+) ", line):
            url = m.group(1)
        if "quill: ready" in line:
            break
    if url is None:
        proc.kill()
        raise SystemExit("the server did not start")
    # Keep reading its output, or a full pipe would one day block the server.
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    return proc, url


class _Connection:
    """One keep-alive HTTP/1.1 connection speaking just enough to stream a completion.

    The clients share the 2 cores with the server: httpx cost ~0.5 ms of CPU per token, as
    much as the API process itself, so the load generator is raw asyncio streams instead.
    """

    def __init__(self, url: str) -> None:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def stream(
        self, body: dict, path: bytes = b"/v1/completions", token_mark: bytes = b'"text"'
    ) -> tuple[list[float], dict]:
        """POST `path` (a streamed completion); the arrival time of each chunk holding
        `token_mark` (one token each), and the last chunk."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        data = json.dumps(body).encode()
        self.writer.write(
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (path, self.host.encode(), len(data), data)
        )
        reader = self.reader
        status = await reader.readline()
        if b" 200 " not in status:
            raise RuntimeError(f"server answered {status!r}")
        while (await reader.readline()) not in (b"\r\n", b""):
            pass  # headers: the body is chunked (a streaming response)
        arrivals, last = [], None
        while True:
            size = int((await reader.readline()).strip(), 16)
            if size == 0:
                await reader.readline()
                return arrivals, last
            chunk = await reader.readexactly(size + 2)
            for event in chunk.split(b"\n\n"):  # a chunk may carry several events
                if b'"usage"' in event:  # only events with usage are parsed: the client stays light
                    last = json.loads(event[event.index(b"{") : event.rindex(b"}") + 1])
                elif token_mark in event:
                    arrivals.append(time.perf_counter())

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def run_clients(url: str, clients: int, prompts: list[list[int]], max_tokens: int) -> dict:
    per_client = [prompts[i::clients] for i in range(clients)]
    gaps: list[float] = []
    ttfts: list[float] = []

    async def client_loop(mine: list[list[int]]) -> int:
        conn = _Connection(url)
        tokens = 0
        try:
            for prompt in mine:
                body = {
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                sent = time.perf_counter()
                arrivals, last = await conn.stream(body)
                ttfts.append(arrivals[0] - sent)
                gaps.extend(b - a for a, b in zip(arrivals, arrivals[1:]))
                tokens += last["usage"]["completion_tokens"]
        finally:
            conn.close()
        return tokens

    start = time.perf_counter()
    counts = await asyncio.gather(*(client_loop(m) for m in per_client))
    wall = time.perf_counter() - start
    tokens = sum(counts)
    return {
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * statistics.median(ttfts),
        "itl_p50_ms": 1000 * statistics.median(gaps),
    }


class _OpenConsole:
    """The console held open in a browser of its own (a child process) for one run."""

    def __init__(self, url: str) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "console_browser.py")
        self.proc = subprocess.Popen(
            [sys.executable, script, url], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the console browser did not start")
        self.ready_s = json.loads(line)["ready_s"]
        time.sleep(2.0)  # a page the operator has had open a while, not one still starting

    def close(self) -> dict:
        out, _ = self.proc.communicate("", timeout=60)
        seen = json.loads(out.strip().splitlines()[-1])
        return {"ready_s": self.ready_s, "redraws_per_s": seen["updates"] / seen["seconds"]}


class _Poller:
    """The page's requests without the page: /console/state fetched at the page's pace by a
    thread, so that the server's share of the console's cost shows apart from the browser's."""

    def __init__(self, url: str, interval: float = 0.75) -> None:
        import http.client

        host, port = url.removeprefix("http://").rsplit(":", 1)
        self.conn = http.client.HTTPConnection(host, int(port), timeout=30)
        self.interval, self.polls = interval, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            started = time.perf_counter()
            self.conn.request("GET", "/console/state")
            self.conn.getresponse().read()
            self.polls += 1
            self.stop.wait(max(0.0, self.interval - (time.perf_counter() - started)))

    def close(self) -> dict:
        self.stop.set()
        self.thread.join(30)
        self.conn.close()
        return {"polls": self.polls}


CONSOLE_SIDES = ("closed", "polled", "open")


def run_console(args, levels: list[int], url: str) -> dict:
    """Console closed, polled and open on one server, alternating sides round after round."""
    results: dict = {"levels": {}}
    for clients in levels:
        n = max(4, 2 * clients)
        prompts = [prompt_ids(args.prompt_tokens, clients * 1000 + i) for i in range(n)]
        runs: dict[str, list[dict]] = {side: [] for side in CONSOLE_SIDES}
        for r in range(args.rounds):
            k = r % len(CONSOLE_SIDES)
            for side in CONSOLE_SIDES[k:] + CONSOLE_SIDES[:k]:
                page = {"open": _OpenConsole, "polled": _Poller}.get(side, lambda _: None)(url)
                run = asyncio.run(run_clients(url, clients, prompts, args.max_tokens))
                if page is not None:
                    run.update(page.close())
                runs[side].append(run)
                print(f"{clients} streams, round {r}, console {side}: {run}", flush=True)
        best = {side: max(rs, key=lambda x: x["tokens_per_s"]) for side, rs in runs.items()}
        results["levels"][clients] = {"best": best, "rounds": runs}
    return results


def print_console(results: dict) -> None:
    print("| streams | closed: tok/s, ITL p50 | polled / closed: tok/s, ITL | open / closed: "
          "tok/s, ITL | page ready (worst) | redraws/s (fewest) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for clients, level in results["levels"].items():
        c = level["best"]["closed"]

        def ratio(side: str, level=level, c=c) -> str:
            s = level["best"][side]
            return (
                f"{s['tokens_per_s'] / c['tokens_per_s']:.3f}, "
                f"{s['itl_p50_ms'] / c['itl_p50_ms']:.3f}"
            )

        opened = level["rounds"]["open"]
        print(
            f"| {clients} | {c['tokens_per_s']:.1f}, {c['itl_p50_ms']:.1f} ms | {ratio('polled')} "
            f"| {ratio('open')} | {1000 * max(r['ready_s'] for r in opened):.0f} ms | "
            f"{min(r['redraws_per_s'] for r in opened):.2f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--api-cores", default="shared,own")
    parser.add_argument(
        "--bare",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the offline engine with the step observers off",
    )
    parser.add_argument(
        "--console", action="store_true", help="console open in a browser against closed"
    )
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    levels = [int(x) for x in args.levels.split(",")]
    variants = args.api_cores.split(",")
    if args.console:
        proc, url = start_server(variants[0])
        try:
            warm = [prompt_ids(args.prompt_tokens, 10_000 + i) for i in range(8)]
            asyncio.run(run_clients(url, 8, warm, 4))
            results = run_console(args, levels, url)
        finally:
            proc.terminate()
            proc.wait(30)
        finish_results(results, args)
        print_console(results)
        return

    engines = {"offline": LLM()}
    if args.bare:
        engines["bare"] = LLM(predict_ttft=False, cost_accounting=False)
    servers = {v: start_server(v) for v in variants}
    results: dict = {"levels": {}}
    try:
        warm = [prompt_ids(args.prompt_tokens, 10_000 + i) for i in range(8)]
        for llm in engines.values():
            run_offline(llm, 8, warm, 4)
        for _, url in servers.values():
            asyncio.run(run_clients(url, 8, warm, 4))
        for clients in levels:
            n = max(4, 2 * clients)
            prompts = [prompt_ids(args.prompt_tokens, clients * 1000 + i) for i in range(n)]
            sides = [*engines, *variants]
            runs: dict[str, list[dict]] = {side: [] for side in sides}
            for r in range(args.rounds):
                # Alternate the order too, so that drift on the machine hits every side alike.
                for side in sides[r % len(sides) :] + sides[: r % len(sides)]:
                    if side in engines:
                        run = run_offline(engines[side], clients, prompts, args.max_tokens)
                    else:
                        url = servers[side][1]
                        run = asyncio.run(run_clients(url, clients, prompts, args.max_tokens))
                    runs[side].append(run)
                    print(f"{clients} streams, round {r}, {side}: {run}", flush=True)
            best = {side: max(rs, key=lambda x: x["tokens_per_s"]) for side, rs in runs.items()}
            results["levels"][clients] = {"best": best, "rounds": runs}
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)
    finish_results(results, args)
    print(f"best of {args.rounds} alternating rounds; engine defaults (as `quill serve` starts)\n")
    head = " | ".join(f"{v}: tok/s (% offline), ITL p50, TTFT p50" for v in variants)
    bare_head = " bare: tok/s (% offline) |" if args.bare else ""
    print(f"| streams | offline tok/s, decode step p50 |{bare_head} {head} |")
    print("|---|---|" + "---|" * (len(variants) + args.bare))
    for clients, level in results["levels"].items():
        off = level["best"]["offline"]
        cells = []
        if args.bare:
            bare = level["best"]["bare"]["tokens_per_s"]
            cells.append(f"{bare:.1f} ({100 * bare / off['tokens_per_s']:.0f}%)")
        for v in variants:
            s = level["best"][v]
            share = 100 * s["tokens_per_s"] / off["tokens_per_s"]
            cells.append(
                f"{s['tokens_per_s']:.1f} ({share:.0f}%), {s['itl_p50_ms']:.1f} ms, "
                f"{s['ttft_p50_ms']:.0f} ms"
            )
        step = off["decode_step_p50_ms"]
        print(
            f"| {clients} | {off['tokens_per_s']:.1f}, {step:.1f} ms | " + " | ".join(cells) + " |"
        )


def finish_results(results: dict, args) -> None:
    """The machine, date and command beside the figures; written to --json if asked."""
    info = machine_info(torch.get_num_threads())
    results.update(
        date=datetime.now(UTC).isoformat(timespec="seconds"),
        machine=f"{info['cpu']} ({' '.join(info['cpu_flags'])}), {os.cpu_count()} cpus, "
        f"torch {torch.__version__}",
        machine_info=info,
        command=" ".join([os.path.basename(sys.executable), *sys.argv]),
        config=vars(args),
    )
    print(f"\n{results['machine']}, {results['date']}\n`{results['command']}`\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
