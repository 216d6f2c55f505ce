"""Rank 0's executor: every step plan to every rank, its own slice of the pass, the sampling.

`start_tensor_parallel` checks that the model splits, starts this host's other ranks
(torch.multiprocessing, spawn: fresh interpreters), joins them in one process group and builds
rank 0's slice beside them; on other hosts `quill tp-node` (`run_node`) starts theirs, which
join the same group at rank 0's address. Each step rank 0 broadcasts the plan (bytes of
quill.contract.codec, the same message the engine process speaks) and all ranks run the layers;
only rank 0 maps its rows to logits and samples, so what it returns is what a single rank
would.

Failure: a rank that exits is seen before the next step (its process's sentinel) or at the
first collective that needs it (its sockets close); one that hangs, when a collective times out
(EngineConfig.distributed_timeout). Either way the pass raises ExecutorFailedError: the group
cannot go on, so the engine stops (the server fails what is in flight and exits non-zero) and
the remaining ranks exit when rank 0's sockets close or its process is gone.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import signal
import threading
import time
from multiprocessing.connection import wait

import torch

from quill.config import EngineConfig
from quill.contract.codec import Codec
from quill.contract.errors import ExecutorFailedError
from quill.contract.plan import StepPlan, StepResult
from quill.distributed.group import TensorParallel, free_port, join_group
from quill.distributed.shard import check_tensor_parallel
from quill.lifetime import die_with_parent
from quill.model.factory import build_model_executor, model_path_of
from quill.model.loader import read_model_config, resolve_device

log = logging.getLogger(__name__)


class TensorParallelExecutor:
    """The engine core's executor over a group of ranks, this process being rank 0."""

    def __init__(self, runner, tp: TensorParallel, processes: list, threads: int) -> None:
        self.runner = runner  # rank 0's ModelRunner, its slice of the model
        self.tp = tp
        self.processes = processes  # ranks 1..N-1
        self._threads = threads  # this process's compute threads before rank 0 took its share
        self._codec = Codec()
        self._closed = False
        self._failed = False  # a pass failed: the ranks are out of step, none can be told

    @property
    def layouts(self):
        return self.runner.layouts

    @property
    def model(self):
        """Rank 0's slice of the model: its weights' formats are every rank's."""
        return self.runner.model

    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.sample(self.forward_pass(plan))

    def forward_pass(self, plan: StepPlan):
        """The pass on every rank. Any error here leaves the ranks out of step with each other
        (some wait in a collective the others never reach): it is fatal."""
        self._check_ranks()
        try:
            self.tp.broadcast_bytes(self._codec.encode(plan))
            return self.runner.forward_pass(plan)
        except Exception as e:
            self._failed = True
            self._check_ranks()
            raise ExecutorFailedError(f"the tensor-parallel pass failed: {e}") from e

    def _check_ranks(self) -> None:
        if self._closed:
            raise ExecutorFailedError("the tensor-parallel group was closed")
        for rank, proc in enumerate(self.processes, start=1):
            if not proc.is_alive():
                self._failed = True
                raise ExecutorFailedError(
                    f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}"
                )

    def close(self, timeout: float = 10.0) -> None:
        """Tell the ranks to stop, wait for them, leave the group."""
        if self._closed:
            return
        self._closed = True
        if self._failed:
            timeout = 0.0  # the ranks cannot follow a broadcast any more: stop them
        else:
            try:
                self.tp.broadcast_bytes(None)
            except Exception:  # noqa: BLE001 - a rank already gone: it will not need telling
                log.warning("tensor parallel: a rank was gone at close")
        deadline = time.monotonic() + timeout
        for proc in self.processes:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        self.tp.close()
        torch.set_num_threads(self._threads)


# What every rank must be started with alike (a host's own paths and its place may differ).
_SHARED_OPTIONS = ("dtype", "kv_cache_dtype", "quantization", "load_format", "block_size",
                   "max_model_len", "max_num_seqs", "max_num_batched_tokens", "kv_cache_memory",
                   "seed", "tensor_parallel_size", "nnodes")  # fmt: skip


def node_ranks(config: EngineConfig) -> range:
    """The global ranks that run on this host (node `node_rank` of `nnodes`)."""
    per_node = config.tensor_parallel_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def _spawn(config: EngineConfig, ranks, address: str) -> tuple[list, object]:
    context = torch.multiprocessing.get_context("spawn")
    options = dataclasses.asdict(config)
    level = logging.getLogger("quill").getEffectiveLevel()
    started = context.Queue()
    processes = []
    for rank in ranks:
        proc = context.Process(
            target=run_rank,
            args=(rank, address, options, os.getpid(), level, started),
            name=f"quill-tp-rank-{rank}",
            daemon=True,
        )
        proc.start()
        processes.append(proc)
    return processes, started


def _address(config: EngineConfig) -> str:
    return f"{config.master_addr}:{config.master_port or free_port()}"


def start_tensor_parallel(config: EngineConfig):
    """Start this host's other ranks, join the group as rank 0, build rank 0's slice: the
    ModelExecutor of the group (its runner a TensorParallelExecutor). With several hosts,
    the others run `quill tp-node` (run_node) with the same flags."""

    size = config.tensor_parallel_size
    if config.node_rank != 0:
        raise ValueError("the engine runs on node 0; the other nodes run `quill tp-node`")
    check_tensor_parallel(read_model_config(model_path_of(config), config.load_format), size)
    device = resolve_device(config.device)
    address = _address(config)
    threads = torch.get_num_threads()
    processes, started = _spawn(config, node_ranks(config)[1:], address)
    log.info(
        "tensor parallel: %d ranks over %d node(s), group at %s (rank 0 here; this host's other "
        "ranks: pids %s)",
        size,
        config.nnodes,
        address,
        [p.pid for p in processes],
    )
    tp = None
    try:
        _wait_started(processes, started)
        if device.type == "cuda":
            device = torch.device("cuda", 0)
        tp = join_group(0, size, address, device, config.distributed_timeout, len(processes) + 1)
        _agree_on_options(tp, config)
        built = build_model_executor(config, tp)
    except BaseException:
        for proc in processes:
            proc.kill()
        if tp is not None:
            tp.close()
        torch.set_num_threads(threads)
        raise
    built.runner = TensorParallelExecutor(built.runner, tp, processes, threads)
    return built


def run_node(config: EngineConfig) -> int:
    """`quill tp-node`: run this host's ranks of a group whose rank 0 is on node 0, until they
    end; 1 if any failed."""

    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine (`quill serve`); tp-node is for the others")
    check_tensor_parallel(
        read_model_config(model_path_of(config), config.load_format), config.tensor_parallel_size
    )
    ranks = node_ranks(config)
    processes, started = _spawn(config, ranks, _address(config))
    log.info("tp-node %d: ranks %s joining %s", config.node_rank, list(ranks), _address(config))
    try:
        _wait_started(processes, started, first_rank=ranks.start)
        while processes:
            wait([p.sentinel for p in processes])
            for proc in [p for p in processes if not p.is_alive()]:
                processes.remove(proc)
                if proc.exitcode != 0:
                    log.error("%s exited with code %s", proc.name, proc.exitcode)
                    return 1
        return 0
    finally:
        for proc in processes:
            proc.kill()


def _agree_on_options(tp: TensorParallel, config: EngineConfig) -> None:
    """Every rank must cut and size the model alike: rank 0's options, checked on each."""
    mine = {name: getattr(config, name) for name in _SHARED_OPTIONS}
    theirs = json.loads(tp.broadcast_bytes(json.dumps(mine).encode() if tp.is_driver else None))
    differ = [f"{k}: {v!r} here, {theirs[k]!r} at 0" for k, v in mine.items() if v != theirs[k]]
    if differ:
        raise ValueError(f"rank {tp.rank} was started with other options: {'; '.join(differ)}")


def _wait_started(processes: list, started, first_rank: int = 1) -> None:
    """Until every rank has started (so rank 0 does not wait out the group's timeout for one
    that died on its way in)."""
    waiting = {first_rank + i for i in range(len(processes))}
    while waiting:
        try:
            waiting.discard(started.get(timeout=0.2))
        except queue.Empty:
            for rank, proc in enumerate(processes, start=first_rank):
                if not proc.is_alive():
                    raise ExecutorFailedError(
                        f"tensor-parallel rank {rank} exited with code {proc.exitcode} while "
                        "starting (its log says why; a script that starts an engine with "
                        "tensor_parallel_size > 1 needs `if __name__ == '__main__':`, as "
                        "spawned processes import it again)"
                    ) from None


def run_rank(rank: int, address: str, options: dict, parent_pid: int, level: int, started) -> None:
    """A rank's life: join the group, build its slice, run every plan rank 0 sends."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(f"%(levelname)s %(name)s (rank {rank}): %(message)s"))
    logger = logging.getLogger("quill")
    logger.handlers[:] = [handler]
    logger.setLevel(max(level, logging.WARNING))  # rank 0 says what every rank does
    logger.propagate = False
    die_with_parent(signal.SIGKILL, parent_pid)  # nothing to end cleanly: the group is gone
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()

    config = EngineConfig(**options)
    local = node_ranks(config)
    device = resolve_device(config.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank - local.start)
        torch.cuda.set_device(device)
        config = dataclasses.replace(config, device=str(device))
    started.put(rank)
    size = config.tensor_parallel_size
    tp = join_group(rank, size, address, device, config.distributed_timeout, len(local))
    try:
        _agree_on_options(tp, config)
        runner = build_model_executor(config, tp).runner
        runner.computes_logits = False
        codec = Codec()
        while (data := tp.broadcast_bytes(None)) is not None:
            runner.forward_pass(codec.decode(data))
    except Exception:
        log.exception("tensor-parallel rank %d failed", rank)
        os._exit(1)  # at once: rank 0 sees the closed sockets, not a hang
    tp.close()


def _watch_parent(parent_pid: int) -> None:
    while True:
        time.sleep(0.5)
        if os.getppid() != parent_pid:  # rank 0's process is gone: nothing left to serve
            os._exit(1)
