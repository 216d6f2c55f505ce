"""Threads with a stack large enough for the grammar library.

llguidance compiles a grammar by recursion on the calling thread's C stack: a chain of a few
thousand `$ref`s or Lark rules overflowed the 8 MiB a Python thread gets by default, and a
stack overflow ends the whole process, not the request. Here every compile runs on a thread
whose stack is `STACK_BYTES` (address space reserved, pages touched only as used), 32 times
the default; the front end's limits (quill/frontend/json_limits.py) keep what a client can send
far inside it.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future

STACK_BYTES = 256 << 20
_stack_size_lock = threading.Lock()


class DeepStackThreads:
    """A small pool of daemon threads with deep stacks: `submit(fn, *args)` -> Future. The
    threads end with `close`, or when the pool is no longer referenced."""

    def __init__(self, num_threads: int, name: str, stack_bytes: int = STACK_BYTES) -> None:
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        # threading.stack_size is process-wide: set it only while these threads are made.
        with _stack_size_lock:
            previous = threading.stack_size(stack_bytes)
            try:
                for i in range(num_threads):
                    threading.Thread(
                        target=_serve, args=(self._tasks,), name=f"{name}-{i}", daemon=True
                    ).start()
            finally:
                threading.stack_size(previous)
        self._finalizer = weakref.finalize(self, _stop, self._tasks, num_threads)

    def submit(self, fn: Callable, *args) -> Future:
        future: Future = Future()
        self._tasks.put((future, fn, args))
        return future

    def close(self) -> None:
        self._finalizer()


def _stop(tasks: queue.SimpleQueue, num_threads: int) -> None:
    for _ in range(num_threads):
        tasks.put(None)


def _serve(tasks: queue.SimpleQueue) -> None:
    while (task := tasks.get()) is not None:
        _run(*task)
        del task  # nothing of it stays referenced while the thread waits


def _run(future: Future, fn: Callable, args: tuple) -> None:
    if not future.set_running_or_notify_cancel():
        return
    try:
        result = fn(*args)
    except BaseException as e:  # noqa: BLE001 - the caller gets it through the future
        future.set_exception(e)
    else:
        future.set_result(result)
