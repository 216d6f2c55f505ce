"""`quill serve --model NAME=PATH ... | --model-dir DIR`: several models behind one address,
each loaded on its first request (quill/server/models/pool.py, front.py)."""

from __future__ import annotations

import argparse
import math
import os

import uvicorn

from quill.server.models.pool import ModelPool, Slot
from quill.server.models.spec import engine_config, model_entries
from quill.server.uvicorn_server import DrainingServer


def add_model_pool_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        dest="models",
        action="append",
        metavar="NAME=PATH[:option=value...]",
        help="serve several models, each loaded on its first request (repeat the flag); "
        "options are the engine's flags without dashes, e.g. NAME=PATH:quantization=int4",
    )
    parser.add_argument(
        "--model-dir",
        dest="model_dirs",
        action="append",
        metavar="DIR",
        help="serve every .gguf file and model directory in DIR, by its name",
    )
    parser.add_argument(
        "--max-loaded-models", type=int, default=3, help="models loaded at once (default 3)"
    )
    parser.add_argument(
        "--models-memory",
        default=None,
        metavar="BYTES",
        help="memory the loaded models may hold together (e.g. 12GiB; default: 90%% of the "
        "memory available at start); the least recently used idle model is unloaded for room",
    )
    parser.add_argument(
        "--idle-unload",
        type=float,
        default=300.0,
        metavar="S",
        help="unload a model nobody used for S seconds (default 300, Ollama's keep_alive; "
        "-1: never); an Ollama request's keep_alive sets its model's",
    )
    parser.add_argument(
        "--load-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="longest a request waits for its model to load (default 600)",
    )


def is_multi_model(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "models", None) or getattr(args, "model_dirs", None))


class MultiModelServer(DrainingServer):
    def __init__(self, config: uvicorn.Config, pool: ModelPool, announce: bool = True) -> None:
        super().__init__(config, announce)
        self.pool = pool

    def drain(self) -> None:
        self.pool.drain()

    def ready_lines(self) -> list[str]:
        url, names = self.base_url, ", ".join(self.pool.slots)
        return [f"quill: serving {names} at {url} (each loaded on its first request; OpenAI "
                f"API: {url}/v1, Ollama's: {url}/api)"]  # fmt: skip


def build_multi_server(args: argparse.Namespace, announce: bool = True) -> MultiModelServer:
    """The models' pool and its front; nothing is loaded yet. ValueError for a bad flag."""
    from quill.engine_args import parse_bytes
    from quill.model.memory_plan import host_available_memory
    from quill.server.app import build_app
    from quill.server.cores import split_cores
    from quill.server.engine_client import EngineClient
    from quill.server.models.front import build_front
    from quill.server.responses.store import ResponseStore
    from quill.server.serve import make_context

    entries = model_entries(args)
    budget = (parse_bytes(args.models_memory) if args.models_memory
              else int(0.9 * host_available_memory()))  # fmt: skip
    if args.max_loaded_models < 1:
        raise ValueError("--max-loaded-models must be at least 1")
    store = ResponseStore(args.responses_store_size, args.responses_store_ttl)

    def start_engine(slot: Slot) -> EngineClient:
        return EngineClient(slot.config, log_level=args.log_level, api_core=args.api_core)

    def make_app(slot: Slot, engine: EngineClient):
        ctx = make_context(args, engine, [slot.entry.name])
        return ctx, build_app(ctx, manage_engine=False, store=store)

    slots = {e.name: Slot(e, engine_config(e, args)) for e in entries}
    idle = math.inf if args.idle_unload < 0 else args.idle_unload
    # The engines' cores, before any engine starts (starting one may pin this process).
    cpus = sorted(split_cores(args.api_core)[1] or os.sched_getaffinity(0))
    pool = ModelPool(slots, start_engine, make_app, budget, args.max_loaded_models, idle,
                     args.load_timeout, cpus=cpus)  # fmt: skip
    front = build_front(pool, args.api_key or None, args.max_request_bytes,
                        args.request_body_timeout, args.metrics_require_key)  # fmt: skip
    config = uvicorn.Config(front, host=args.host, port=args.port,
                            log_level=args.log_level.lower(), access_log=not args.no_access_log,
                            lifespan="on", timeout_graceful_shutdown=10,
                            timeout_keep_alive=5)  # fmt: skip
    return MultiModelServer(config, pool, announce)
