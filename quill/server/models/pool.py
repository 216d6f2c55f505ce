"""Several models in one server, each in an engine process of its own, loaded when a request
asks for it and unloaded when room is needed or nobody used it for a while.

- A request for a model not loaded starts its engine (quill/server/engine_client.py) and waits
  for it, bounded by `load_timeout`; requests for the same model wait on the same load. Loads
  run one at a time (each takes the cores, and the room each needs is decided in turn).
- Room: at most `max_loaded` models, and their memory within `budget` bytes. Before a load,
  the least recently used models with nothing in flight are unloaded until the new model's
  estimate fits (an estimate from its files and KV pool until it is measured loaded; then its
  engine's resident memory). A model with requests in flight is never unloaded: the load
  waits for one to finish, within its timeout. A model whose estimate alone is past the
  budget is refused with the figures.
- `keep_alive` (seconds after its last request; inf: never; 0: as soon as it is idle) is the
  server's `--idle-unload`, or what the model's last Ollama request said.
- A load that fails fails the requests waiting on it with its message; the next request tries
  again. An engine that dies unloads its model; the others keep serving.
- Cores: while a model loads beside loaded ones, the loaded models keep to the first half of
  the engines' cores (one compute thread each), the loader has them all; afterwards every
  engine has every core back. With all of them on every core, the threads of the loader and
  of the serving engines contended for each core and a serving model ran at 0.12x its pace
  (benchmarks/bench_model_pool.py). The loader is not confined: it times its kernels at
  start-up for its thread count, and one started on half the cores and widened after served
  at 0.46x the pace of one started on all of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from quill.config import EngineConfig
from quill.server.context import ServerContext
from quill.server.engine_client import EngineClient
from quill.server.errors import APIError
from quill.server.models.catalog import ModelEntry
from quill.server.models.memory import process_tree_rss

log = logging.getLogger(__name__)

# An engine process before its model: the interpreter, torch and its libraries (measured
# 0.37 GiB resident here with all-MiniLM-L6-v2 loaded).
RUNTIME_BYTES = 512 << 20
# Before a model's first load, its files times this stand for its weights in memory: float
# weights may gain int8 copies (`auto`) or be widened (a 16-bit file served in fp32), a GGUF
# file's tables may be dequantized (Gemma 3 270M Q4_K_M: 0.24 GiB of file, 1.81 GiB resident
# with a 0.5 GiB KV pool). Once loaded, the model's measured memory replaces the estimate.
FIRST_LOAD_FACTOR = 3.0


@dataclass
class Slot:
    entry: ModelEntry
    config: EngineConfig
    state: str = "unloaded"  # unloaded, loading, loaded
    ctx: ServerContext | None = None
    app: object | None = None  # the model's own app (quill/server/app.py)
    loading: asyncio.Future | None = None
    last_used: float = 0.0
    keep_alive: float | None = None  # None: the pool's default
    active: int = 0  # requests being served through the front now
    rss: int = 0  # measured once loaded (and kept: the next load of it is known)
    error: str | None = None  # the last load's failure
    loaded_at: float = 0.0
    load_seconds: float = 0.0
    loads: int = 0

    @property
    def busy(self) -> bool:
        return self.active > 0 or (self.ctx is not None and self.ctx.engine.num_in_flight > 0)

    def estimate(self) -> int:
        """Bytes the model holds, or will: as measured (now, or when it was last loaded),
        else a generous estimate from its files."""
        if self.state == "loaded" and self.ctx is not None:
            self.rss = max(self.rss, process_tree_rss(self.ctx.engine.pid))
        if self.rss:
            return self.rss
        kv = self.config.kv_cache_memory or 0
        return int(self.entry.size * FIRST_LOAD_FACTOR) + kv + RUNTIME_BYTES

    def least(self) -> int:
        """The least the model can hold: its files, its KV pool and the runtime."""
        return self.entry.size + (self.config.kv_cache_memory or 0) + RUNTIME_BYTES


@dataclass
class ModelPool:
    slots: dict[str, Slot]
    start_engine: Callable[[Slot], EngineClient]  # an engine client for the slot (not started)
    make_app: Callable[[Slot, EngineClient], tuple[ServerContext, object]]
    budget: int
    max_loaded: int
    idle_unload: float = 300.0  # the default keep_alive (s); inf: never
    load_timeout: float = 600.0
    cpus: list[int] = field(default_factory=list)  # the engines' cores (empty: not split)
    _load_lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False

    @property
    def default_name(self) -> str:
        return next(iter(self.slots))

    def slot(self, name: str | None) -> Slot:
        slot = self.slots.get(name or self.default_name)
        if slot is None:
            raise APIError(404, f"model '{name}' not found", param="model",
                           code="model_not_found")  # fmt: skip
        return slot

    def loaded(self) -> list[Slot]:
        return [s for s in self.slots.values() if s.state == "loaded"]

    def used(self) -> int:
        """Bytes the loaded models hold (a loading one: its estimate)."""
        return sum(s.estimate() for s in self.slots.values() if s.state != "unloaded")

    async def ready(self, slot: Slot) -> float:
        """Load the model if it is not loaded; returns the seconds this call waited for it.
        APIError when it cannot be loaded (the reason in its message)."""
        if slot.state == "loaded" and slot.ctx.engine.is_alive:
            return 0.0
        if slot.state == "loaded":  # its engine died: start again
            await self.unload(slot, "its engine stopped")
        started = time.monotonic()
        if slot.loading is None:
            slot.loading = asyncio.ensure_future(self._load(slot))
        try:
            await asyncio.shield(slot.loading)
        except APIError:
            raise
        except Exception as e:  # noqa: BLE001 - a load's failure, whatever it is, is its message
            raise APIError(500, f"model '{slot.entry.name}' could not be loaded: {e}",
                           "server_error") from None  # fmt: skip
        return time.monotonic() - started

    async def _load(self, slot: Slot) -> None:
        try:
            async with self._load_lock:
                if self.closed:
                    raise APIError(503, "the server is shutting down", "server_error")
                need = min(slot.estimate(), self.budget)
                least = slot.least() if not slot.rss else slot.rss
                if least > self.budget:
                    raise APIError(
                        507,
                        f"model '{slot.entry.name}' needs at least {least / (1 << 30):.2f} GiB "
                        f"(weights {slot.entry.size / (1 << 30):.2f} GiB, KV "
                        f"{(slot.config.kv_cache_memory or 0) / (1 << 30):.2f} GiB, runtime "
                        f"{RUNTIME_BYTES / (1 << 30):.2f} GiB); the models' budget is "
                        f"{self.budget / (1 << 30):.2f} GiB (--models-memory)",
                        "server_error",
                    )
                await self._make_room(slot, need)
                slot.state = "loading"
                log.info("model %s: loading %s (about %.2f GiB)", slot.entry.name,
                         slot.entry.path, need / (1 << 30))  # fmt: skip
                started = time.monotonic()
                engine = self.start_engine(slot)
                serving = [s for s in self.loaded() if s is not slot]
                split = len(self.cpus) >= 2 and bool(serving)
                if split:  # the loaded models keep to the first half of the cores meanwhile
                    await self._pin(serving, self.cpus[: len(self.cpus) // 2])
                try:
                    await asyncio.to_thread(engine.start_process, self.load_timeout)
                    await engine.start()
                except BaseException:
                    engine.join(5)
                    raise
                finally:
                    if split:
                        await self._pin(serving, self.cpus)
                slot.ctx, slot.app = self.make_app(slot, engine)
                engine.on_death = lambda message, s=slot: self._died(s, message)
                slot.rss = process_tree_rss(engine.pid)
                slot.state, slot.error = "loaded", None
                slot.loaded_at = slot.last_used = time.monotonic()
                slot.load_seconds = slot.loaded_at - started
                slot.loads += 1
                log.info("model %s: loaded in %.1f s, %.2f GiB resident", slot.entry.name,
                         slot.load_seconds, slot.rss / (1 << 30))  # fmt: skip
        except BaseException as e:
            if slot.state == "loading":
                slot.state = "unloaded"
            slot.error = str(e)
            log.error("model %s: not loaded: %s", slot.entry.name, e)
            raise
        finally:
            slot.loading = None

    async def _pin(self, slots: list[Slot], cpus: list[int]) -> None:
        for s in slots:
            if s.state == "loaded" and s.ctx.engine.is_alive:
                await self._pin_engine(s.ctx.engine, cpus)

    @staticmethod
    async def _pin_engine(engine: EngineClient, cpus: list[int]) -> None:
        try:
            await asyncio.wait_for(engine.call("cores", list(cpus)), 30)
        except Exception as e:  # noqa: BLE001 - a slower model, not a failed one
            log.warning("could not move engine %s to cores %s: %s", engine.pid, cpus, e)

    async def _make_room(self, slot: Slot, need: int) -> None:
        """Unload idle models, least recently used first, until `need` more bytes and one
        more model fit; wait for busy ones to finish, within the load timeout."""
        deadline = time.monotonic() + self.load_timeout
        while True:
            others = [s for s in self.loaded() if s is not slot]
            fits = len(others) < self.max_loaded and self.used() + need <= self.budget
            if fits:
                return
            idle = sorted((s for s in others if not s.busy), key=lambda s: s.last_used)
            if idle:
                await self.unload(idle[0], f"room for {slot.entry.name}")
                continue
            if time.monotonic() > deadline:
                names = ", ".join(s.entry.name for s in others)
                raise APIError(503, f"no room to load model '{slot.entry.name}': the loaded "
                               f"models ({names}) all have requests in flight", "server_error",
                               headers={"Retry-After": "5"})  # fmt: skip
            await asyncio.sleep(0.05)

    async def unload(self, slot: Slot, why: str) -> None:
        if slot.state != "loaded":
            return
        log.info("model %s: unloading (%s)", slot.entry.name, why)
        ctx = slot.ctx
        slot.estimate()  # its memory as last measured: the next load of it is known
        idle = not slot.busy
        slot.state, slot.ctx, slot.app = "unloaded", None, None
        await ctx.engine.stop(idle=idle)

    def _died(self, slot: Slot, message: str) -> None:
        log.error("model %s: its engine stopped (%s); the next request loads it again",
                  slot.entry.name, message)  # fmt: skip
        slot.error = message

    def used_by(self, slot: Slot, keep_alive: float | None) -> None:
        """A request for the model began: its idle clock restarts, and its keep_alive is the
        request's (None: the server's default), as each Ollama request sets it."""
        slot.last_used = time.monotonic()
        slot.keep_alive = keep_alive

    def touch(self, slot: Slot) -> None:
        """A request for the model ended: its idle clock restarts."""
        slot.last_used = time.monotonic()

    def expires_at(self, slot: Slot) -> float | None:
        """Wall time the model unloads if nobody uses it (None: never)."""
        keep = self.idle_unload if slot.keep_alive is None else slot.keep_alive
        if math.isinf(keep):
            return None
        return time.time() + keep - (time.monotonic() - slot.last_used)

    async def unload_idle(self) -> None:
        """One pass of the idle clock: unload each idle model past its keep_alive."""
        now = time.monotonic()
        for slot in self.loaded():
            keep = self.idle_unload if slot.keep_alive is None else slot.keep_alive
            if not slot.busy and now - slot.last_used >= keep:
                await self.unload(slot, f"idle for {now - slot.last_used:.0f} s")

    async def run_idle_clock(self) -> None:
        while not self.closed:
            await asyncio.sleep(0.25)
            try:
                await self.unload_idle()
            except Exception:  # noqa: BLE001 - the clock must keep going
                log.exception("unloading idle models failed")

    async def close(self) -> None:
        self.closed = True
        for slot in self.loaded():
            await self.unload(slot, "the server is stopping")

    def drain(self) -> None:
        for slot in self.loaded():
            slot.ctx.engine.drain()
