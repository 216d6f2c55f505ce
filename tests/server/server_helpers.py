"""Helpers shared by the server tests (imported by name: tests/server is on sys.path)."""

from __future__ import annotations

import time

API_KEY = "test-key"


def sample(values: dict, name: str, **labels) -> float:
    return values.get((name, frozenset(labels.items())), 0.0)


def wait_until(condition, timeout: float = 30.0, interval: float = 0.05):
    """Poll until condition() is truthy; a guard against hangs, not a timing assertion."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(interval)


def engine_call(server, name: str, *args, timeout: float = 30.0):
    """Run a utility of the server's engine process (quill/engine/process.py) from a test
    thread: "state", "pause", "resume", "inject_fault"."""
    import asyncio

    future = asyncio.run_coroutine_threadsafe(server.ctx.engine.call(name, *args), server.loop)
    return future.result(timeout)


def still_running(processes, timeout: float) -> list:
    """Those of `processes` (psutil.Process) still running after `timeout` seconds; an ended
    process that nobody has reaped yet (a zombie) counts as ended."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        running = []
        for p in processes:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    running.append(p)
            except psutil.NoSuchProcess:
                pass
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.05)
