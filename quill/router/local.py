"""`quill serve --disaggregate P:D` (and `--data-parallel-size N`): a router and its instances
on this machine, each instance a `quill serve` process pinned to its share of the cores.

The instances get the serve command's own flags (model, engine options) and ports of their
own; the router takes the command's --host and --port. Data-parallel replicas publish their
KV-cache events (on free local ports) for the router's cache-aware policy, which reads
prompts with the model's own tokenizer. A replica that exits is taken out of the rotation and
the others serve on (the whole stops, status 1, when none is left); a split stops when any of
its instances exits (a supervisor restarts it), never a router answering for one gone.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import uvicorn

from quill.distributed.ports import free_port
from quill.lifetime import child_setup
from quill.router.app import build_router_app, policy_settings
from quill.router.instances import DECODE, PREFILL, WHOLE
from quill.server.uvicorn_server import CleanExitServer

_OWN_FLAGS = {
    "--disaggregate": 1,
    "--replicas": 1,
    "--data-parallel-size": 1,
    "--port": 1,
    "--host": 1,
    "--router-policy": 1,
    "--router-cache-threshold": 1,
    "--router-balance-abs-threshold": 1,
    "--router-balance-rel-threshold": 1,
    "--data-parallel-backend": 1,
    "--ray-address": 1,
    "--cpus-per-replica": 1,
}


def parse_split(text: str) -> tuple[int, int]:
    """'P:D' -> (P, D), each at least 1."""
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--disaggregate takes P:D (e.g. 1:1), got {text!r}") from None
    if p < 1 or d < 1:
        raise ValueError(f"--disaggregate needs at least one of each, got {text!r}")
    return p, d


def share_cores(cores: list[int], n: int) -> list[set[int]]:
    """`n` groups of these cores, as even as can be (fewer cores than groups: they share)."""
    if len(cores) < n:
        return [{cores[i % len(cores)]} for i in range(n)]
    size, extra = divmod(len(cores), n)
    groups, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        groups.append(set(cores[start:end]))
        start = end
    return groups


def instance_argv(serve_argv: list[str]) -> list[str]:
    """The serve command's flags but those of the router's own."""
    out, skip = [], 0
    for arg in serve_argv:
        if skip:
            skip -= 1
            continue
        name = arg.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = 0 if "=" in arg else _OWN_FLAGS[name]
            continue
        out.append(arg)
    return out


def wait_healthy(proc: subprocess.Popen, url: str, deadline: float) -> None:
    """Until the server `proc` runs answers `url`/health; RuntimeError if it exits first or
    the deadline (monotonic) passes."""
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the instance at {url} exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the instance at {url} did not start in time")
        time.sleep(0.2)


class LocalCluster:
    """The instance processes; `start` waits until all answer /health."""

    def __init__(self, roles: list[str], serve_argv: list[str]) -> None:
        self.roles = roles
        self.argv = instance_argv(serve_argv)
        self.cores = share_cores(sorted(os.sched_getaffinity(0)), len(roles))
        self.ports = [free_port() for _ in roles]
        self.procs: list[subprocess.Popen] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def start(self, timeout_s: float = 900.0) -> None:
        for rank, (role, port, cores) in enumerate(zip(self.roles, self.ports, self.cores)):
            cmd = [sys.executable, "-m", "quill.cli", "serve", *self.argv, "--port", str(port)]
            if "--no-access-log" not in self.argv:  # the router's polls would fill it
                cmd.append("--no-access-log")
            if role != WHOLE:
                cmd += ["--role", role]
            elif "--kv-events-config" not in self.argv:  # for the cache-aware router
                events = {
                    "enable_kv_cache_events": True,
                    "endpoint": f"tcp://127.0.0.1:{free_port()}",
                    "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
                }
                cmd += ["--kv-events-config", json.dumps(events)]
            if role == WHOLE:
                cmd += ["--data-parallel-rank", str(rank)]
            # Each instance records its own steps (FILE.0, FILE.1, ...), never into one file.
            cmd = [f"{arg}.{rank}" if prev == "--record-steps" else arg
                   for prev, arg in zip([None, *cmd], cmd)]  # fmt: skip
            if role == PREFILL:  # its own free port, not the HTTP port + 1 (another's, maybe)
                cmd += ["--kv-transfer-port", str(free_port())]
            print(f"quill: starting a {role} instance on cores {sorted(cores)} at :{port}",
                  flush=True)  # fmt: skip
            # SIGTERM when this process ends, however it ends: the instance drains its
            # streams and stops its engine (quill/lifetime.py).
            self.procs.append(subprocess.Popen(cmd, preexec_fn=child_setup(signal.SIGTERM, cores)))
        deadline = time.monotonic() + timeout_s
        try:
            for proc, url in zip(self.procs, self.urls):
                wait_healthy(proc, url, deadline)
        except RuntimeError:
            self.stop()
            raise

    def watch(self, on_exit) -> None:
        """Call `on_exit(url, message)` from a thread when an instance exits."""

        def wait(proc: subprocess.Popen, url: str) -> None:
            code = proc.wait()
            on_exit(url, f"the instance at {url} exited with {code}")

        for proc, url in zip(self.procs, self.urls):
            threading.Thread(target=wait, args=(proc, url), daemon=True).start()

    def stop(self, timeout_s: float = 15.0) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()


class _RouterServer(CleanExitServer):
    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:  # bound: clients may come
            c = self.config
            print(f"quill: router at http://{c.host}:{c.port} (OpenAI API: /v1)", flush=True)
            print("quill: ready (Ctrl-C to stop)", flush=True)


def run_local(args, serve_argv: list[str]) -> int:
    """Entry point of `quill serve --disaggregate P:D` / `--replicas N`."""
    if args.disaggregate:
        p, d = parse_split(args.disaggregate)
        roles = [PREFILL] * p + [DECODE] * d
    else:
        roles = [WHOLE] * args.replicas
    port = args.port or free_port()  # 0: a free one, named in the ready line
    cluster = LocalCluster(roles, serve_argv)
    try:
        cluster.start()
    except RuntimeError as e:
        print(f"quill serve: {e}", file=sys.stderr)
        return 1
    urls = {PREFILL: [], DECODE: [], WHOLE: []}
    for role, url in zip(roles, cluster.urls):
        urls[role].append(url)
    app = build_router_app(
        urls,
        policy=args.router_policy,
        model=model_path_for(args.model),
        settings=policy_settings(args, "router-"),
        api_key=args.api_key,
    )
    server = _RouterServer(uvicorn.Config(app, host=args.host, port=port, log_level="warning"))
    failed = []
    gone: set[str] = set()

    def instance_exited(url: str, message: str) -> None:
        gone.add(url)
        # Replicas serve on without one of them (the router takes it out of the rotation);
        # a split needs every instance it was given.
        if args.replicas and len(gone) < len(roles):
            print(f"quill serve: {message}; serving on without it", file=sys.stderr, flush=True)
            return
        if not server.should_exit:
            print(f"quill serve: {message}; stopping", file=sys.stderr, flush=True)
            failed.append(message)
            server.should_exit = True

    cluster.watch(instance_exited)
    try:
        server.run()
    finally:
        server.should_exit = True
        cluster.stop()
    return 1 if failed else 0


def model_path_for(model: str | None) -> str:
    """The model's path (the default or a named model's, made by the replicas' start), whose
    tokenizer and template the router reads prompts with."""
    from quill.config import EngineConfig
    from quill.model.factory import model_path_of

    return str(model_path_of(EngineConfig(model=model)))
