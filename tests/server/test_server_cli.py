"""`quill serve` as real processes: ready line, flags, QUILL_API_KEY, clean stop on signals,
and what a server does when its engine process dies."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil
import pytest
from server_helpers import still_running

from quill.bench.routing import routed_by_reason

KEY = "env-key"


class ServeProcess:
    """`python -m quill.cli serve ...` with its output read line by line in a thread."""

    def __init__(self, *flags: str) -> None:
        cmd = [sys.executable, "-m", "quill.cli", "serve", *flags]
        env = {**os.environ, "QUILL_API_KEY": KEY}
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: queue.Queue[str] = queue.Queue()
        self.log: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match:
        while True:
            try:
                line = self.lines.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no {pattern!r} in output:\n{''.join(self.log)}") from None
            self.log.append(line)
            if m := re.search(pattern, line):
                return m

    def ready(self) -> str:
        """Wait for the ready line; the server's URL."""
        url = self.wait_for(r"(http://127\.0\.0\.1:\d+) ").group(1)
        self.wait_for(r"quill: ready")
        return url

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def engine(self) -> psutil.Process:
        """The engine process (the server's one child)."""
        children = psutil.Process(self.proc.pid).children()
        assert len(children) == 1, children
        return children[0]


SMALL = ("--dtype", "float32", "--kv-cache-memory", "64MiB", "--port", "0",
         "--served-model-name", "smol", "--max-num-seqs", "4", "--no-access-log")  # fmt: skip
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_STREAM = {
    "model": "smol",
    "messages": [{"role": "user", "content": "Tell me a long story."}],
    "max_tokens": 1000,
    "ignore_eos": True,
    "stream": True,
}


def stream_and_kill(c: httpx.Client, kill) -> tuple[list[str], float]:
    """Stream LONG_STREAM, call `kill()` at the third event (a signal, or SIGKILL as the
    out-of-memory killer would); the events, and the seconds from the kill to the stream's
    end."""
    events = []
    with c.stream("POST", "/v1/chat/completions", json=LONG_STREAM, headers=AUTH) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
            if len(events) == 3:
                kill()
                killed = time.monotonic()
    return events, time.monotonic() - killed


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_serve_starts_and_stops_cleanly(sig):
    served = ServeProcess(*SMALL)
    try:
        url = served.ready()
        engine = served.engine()
        auth = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, timeout=60) as c:
            assert c.get("/v1/models").status_code == 401  # the key came from QUILL_API_KEY
            assert [m["id"] for m in c.get("/v1/models", headers=auth).json()["data"]] == ["smol"]
            events, _ = stream_and_kill(c, lambda: served.proc.send_signal(sig))  # mid-stream
            # The stream ended by itself: aborted, then [DONE].
            assert events[-1] == "data: [DONE]"
            assert '"finish_reason":"abort"' in events[-2]
        assert served.proc.wait(timeout=60) == 0
        # The engine process was stopped with it: none is left behind.
        assert not psutil.pid_exists(engine.pid) or engine.status() == psutil.STATUS_ZOMBIE
    finally:
        served.kill()


def test_engine_killed_mid_stream_fails_requests_at_once_and_the_server_exits_non_zero():
    served = ServeProcess(*SMALL)
    try:
        url = served.ready()
        engine = served.engine()
        with httpx.Client(base_url=url, timeout=60) as c:
            events, ended = stream_and_kill(c, engine.kill)
            # The stream ended at once with an error event naming the engine, then [DONE].
            assert events[-1] == "data: [DONE]"
            assert '"error"' in events[-2] and "engine process died" in events[-2]
            assert ended < 1.0, ended
            health = c.get("/health")
            assert health.status_code == 503
            refused = c.post("/v1/chat/completions", json=LONG_STREAM, headers=AUTH)
            assert refused.status_code == 503
        assert served.proc.wait(timeout=30) == 1  # for a supervisor to restart it
    finally:
        served.kill()


def test_disaggregate_serves_through_a_router_and_stops_when_an_instance_dies():
    """`quill serve --disaggregate 1:1`: a prefill and a decode instance, each pinned to its
    own core, behind a router; a reply goes through both; when the decode instance dies the
    whole exits 1 at once, leaving no process behind."""
    served = ServeProcess(*SMALL, "--disaggregate", "1:1")
    try:
        url = served.wait_for(r"router at (http://127\.0\.0\.1:\d+) ", timeout=300).group(1)
        served.wait_for(r"quill: ready")
        instances = psutil.Process(served.proc.pid).children()
        assert len(instances) == 2
        cores = [set(p.cpu_affinity()) for p in instances]
        if len(os.sched_getaffinity(0)) >= 2:
            assert not cores[0] & cores[1]  # each on its own share
        body = {"model": "smol", "prompt": "Once upon a time", "max_tokens": 8,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        with httpx.Client(base_url=url, timeout=60) as c:
            r = c.post("/v1/completions", json=body, headers=AUTH)
            assert r.status_code == 200, r.text
            reply = r.json()
            assert reply["usage"]["completion_tokens"] == 8
            assert reply["metrics"]["kv_transfer_bytes"] > 0  # the KV moved between them
            assert c.get("/health").status_code == 200
        everyone = [p for i in instances for p in [i, *i.children(recursive=True)]]
        instances[1].kill()  # the decode instance
        assert served.proc.wait(timeout=30) == 1
        gone, alive = psutil.wait_procs(everyone, timeout=30)
        assert not alive
    finally:
        served.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])
def test_no_process_outlives_the_router(sig):
    """`quill serve --disaggregate 1:1` started four processes (two instances, their two
    engines); when the router ends on a signal it handles, all four end within 5 s (the
    kernel tells each child its parent ended: quill/lifetime.py). SIGINT takes the same
    path as SIGTERM (tests of a single server send both); SIGKILL of a router: the
    data-parallel test below."""
    served = ServeProcess(*SMALL, "--disaggregate", "1:1")
    family = []
    try:
        served.wait_for(r"router at ", timeout=300)
        served.wait_for(r"quill: ready")
        family = psutil.Process(served.proc.pid).children(recursive=True)
        assert len(family) == 4, family
        served.proc.send_signal(sig)
        assert not still_running(family, timeout=5.0)
        served.proc.wait(5)
    finally:
        served.kill()
        for p in still_running(family, timeout=0):  # after a failure: none left for later tests
            p.kill()


def test_an_engine_still_loading_ends_with_its_server():
    """SIGKILL of `quill serve` while its engine process loads the model: the engine ends too
    (before, it loaded on, then served nobody until its parent watch began)."""
    served = ServeProcess(*SMALL)
    try:
        engine = wait_for_child(served.proc.pid)
        served.proc.kill()
        assert not still_running([engine], timeout=5.0)
    finally:
        served.kill()


def wait_for_child(pid: int, timeout: float = 60.0) -> psutil.Process:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(pid).children()
        if children:
            return children[0]
        time.sleep(0.01)
    raise AssertionError("no engine process was started")


@pytest.mark.device
def test_serve_on_the_device_matches_the_offline_engine(device, llm):
    """`quill serve --device D` end to end: its greedy replies, through the openai client,
    streamed and not, are the offline engine's on the same device and weights."""
    import openai

    from quill import SamplingParams

    exact = ("--kv-cache-dtype", "float32", "--quantization", "none")
    served = ServeProcess(*SMALL, *exact, "--device", device.type)
    try:
        url = served.ready()
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
        prompts = ["The capital of France is", "def fibonacci(n):"]
        greedy = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        want = [o.outputs[0].text for o in llm.generate(prompts, greedy, use_tqdm=False)]
        extra = {"ignore_eos": True}
        for prompt, text in zip(prompts, want, strict=True):
            kw = dict(model="smol", prompt=prompt, max_tokens=16, temperature=0, extra_body=extra)
            assert client.completions.create(**kw).choices[0].text == text
            streamed = client.completions.create(**kw, stream=True)
            assert "".join(c.choices[0].text for c in streamed) == text
    finally:
        served.kill()


def test_data_parallel_replicas_route_by_prefix_and_serve_on_without_a_dead_one():
    """`quill serve --data-parallel-size 2`: two replicas publishing KV-cache events behind the
    cache-aware router. A tenant's later requests go where its long system prompt is cached
    (and hit there); when a replica is SIGKILLed mid-stream, its stream ends with an error,
    the other replica's stream finishes, and the router serves on with the one left; when the
    router is SIGKILLed, no process it started outlives it."""
    served = ServeProcess(*SMALL, "--data-parallel-size", "2")
    family = []
    try:
        url = served.wait_for(r"router at (http://127\.0\.0\.1:\d+) ", timeout=300).group(1)
        served.wait_for(r"quill: ready")
        family = psutil.Process(served.proc.pid).children(recursive=True)
        replicas = psutil.Process(served.proc.pid).children()
        assert len(replicas) == 2
        ports = {p: re.search(r"--port (\d+)", " ".join(p.cmdline())).group(1) for p in replicas}
        tenants = {
            name: f"You are the assistant of {name}. " + f"{name} sells things. " * 40
            for name in ("Acme", "Globex")
        }

        def chat(tenant: str, question: str, **extra) -> dict:
            messages = [{"role": "system", "content": tenants[tenant]},
                        {"role": "user", "content": question}]  # fmt: skip
            return {"model": "smol", "messages": messages, "max_tokens": 2, **extra}

        with httpx.Client(base_url=url, timeout=120, headers=AUTH) as c:
            for i in range(3):
                for tenant in tenants:
                    rid = {"X-Request-Id": f"{tenant}-{i}"}  # a client's id is kept throughout
                    r = c.post("/v1/chat/completions", json=chat(tenant, f"Question {i}?"),
                               headers=rid)  # fmt: skip
                    assert r.status_code == 200, r.text
                    assert r.headers["x-request-id"] == f"{tenant}-{i}"
        routed = routed_by_reason(url)
        assert routed.get("cached") == 4, routed  # all but each tenant's first
        for p in replicas:
            text = httpx.get(f"http://127.0.0.1:{ports[p]}/metrics").text
            hits = re.search(r"^vllm:prefix_cache_hits_total\{[^}]*\} (\S+)", text, re.M)
            assert float(hits.group(1)) > 0, "a replica never found its tenant's prompt"

        # Two long streams, one per tenant (so one per replica); kill one replica.
        results: dict[str, list[str]] = {}

        def stream(tenant: str, max_tokens: int) -> None:
            body = chat(tenant, "Tell me a story.", max_tokens=max_tokens, ignore_eos=True,
                        stream=True)  # fmt: skip
            with httpx.Client(base_url=url, timeout=120, headers=AUTH) as c:
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    results[tenant] = [x for x in r.iter_lines() if x.startswith("data:")]

        threads = {
            "Acme": threading.Thread(target=stream, args=("Acme", 2000)),
            "Globex": threading.Thread(target=stream, args=("Globex", 60)),
        }
        for t in threads.values():
            t.start()

        def busy() -> psutil.Process | None:
            for p in replicas:
                loads = httpx.get(f"http://127.0.0.1:{ports[p]}/v1/loads", headers=AUTH).json()
                if loads["running"] and loads["num_tokens_in_flight"] > 600:
                    return p
            return None

        victim = wait_until_value(busy)  # the replica writing Acme's long reply
        victim.kill()
        threads["Acme"].join(30)
        assert not threads["Acme"].is_alive(), "the dead replica's stream hangs"
        assert '"error"' in results["Acme"][-2] and results["Acme"][-1] == "data: [DONE]"
        threads["Globex"].join(60)
        assert '"finish_reason":"length"' in results["Globex"][-2].replace(" ", "")
        assert served.proc.poll() is None, "the router stopped with a replica left"
        with httpx.Client(base_url=url, timeout=120, headers=AUTH) as c:
            for tenant in tenants:  # both tenants, on the replica left
                r = c.post("/v1/chat/completions", json=chat(tenant, "Still there?"))
                assert r.status_code == 200, (r.text, c.get("/health").text)
        # SIGKILL of the router: the replica left and its engine end within 5 s.
        served.proc.kill()
        assert not still_running(family, timeout=5.0)
    finally:
        served.kill()
        for p in still_running(family, timeout=5.0):  # after a failure: none left for later tests
            p.kill()


def wait_until_value(get, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = get()
        if value is not None:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not met in time")
