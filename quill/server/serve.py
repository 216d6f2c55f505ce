"""`quill serve [MODEL]`: command-line flags, engine start-up and the uvicorn server.

The engine runs in a process of its own (quill/engine/process.py), started and loaded before
the port is bound. SIGINT (Ctrl-C) and SIGTERM stop the server cleanly: new requests are
refused, requests in flight are aborted so their streams end at once (finish_reason "abort"),
uvicorn closes the connections and the engine process is told to stop and waited for. A second
Ctrl-C forces the exit. If the engine process dies, requests in flight fail at once, /health
answers 503, and a second later the server exits with status 1 for a supervisor to restart it.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

import uvicorn

from quill.distributed.ports import free_port
from quill.engine_args import add_engine_arguments, engine_options, parse_bytes
from quill.frontend.chat import REASONING_PARSERS, TOOL_PARSERS, ChatFormat
from quill.frontend.json_limits import JsonLimits
from quill.frontend.pooling_config import PoolingConfig
from quill.frontend.scoring import scorer_for
from quill.server.app import build_app
from quill.server.console.routes import DEFAULT_FIGURE_DIRS
from quill.server.context import ServerContext
from quill.server.models.serve import (
    add_model_pool_arguments,
    build_multi_server,
    is_multi_model,
)
from quill.server.uvicorn_server import DrainingServer

log = logging.getLogger(__name__)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The serve subcommand's flags: MODEL, the engine's flags and the server's own."""
    parser.add_argument(
        "model", nargs="?", default=None, help="HF directory or .gguf (default: SmolLM2-135M)"
    )
    add_engine_arguments(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: local)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("QUILL_API_KEY"),
        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
        "(the console page asks for it once; default: $QUILL_API_KEY)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="sequences (prompts x n) allowed to wait for the engine; past it, 503 with "
        "Retry-After",
    )
    parser.add_argument(
        "--max-seqs-per-request",
        type=int,
        default=256,
        help="most sequences (prompts x n) one request may ask for; past it, 400",
    )
    parser.add_argument(
        "--max-prompt-logprobs-tokens",
        type=int,
        default=16384,
        help="most prompt tokens one request may ask logprobs of (echo with logprobs, "
        "prompt_logprobs; its prompts x n together): each is an entry of the reply; past it, 400",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=parse_bytes,
        default=4 << 20,
        help="largest request body accepted (e.g. 4MiB); past it, 413 before parsing",
    )
    limits = JsonLimits()
    parser.add_argument(
        "--max-json-depth",
        type=int,
        default=limits.max_json_depth,
        help="deepest nesting of objects and arrays in one JSON value inside a request (a "
        "schema, a tool's parameters, a call's arguments); past it, 400",
    )
    parser.add_argument(
        "--max-json-values",
        type=int,
        default=limits.max_json_values,
        help="most values (objects, arrays, strings, numbers) in one such JSON value; past it, 400",
    )
    parser.add_argument(
        "--max-schema-refs",
        type=int,
        default=limits.max_schema_refs,
        help="most $ref references in one JSON schema (a request's tools together); past it, 400",
    )
    parser.add_argument(
        "--max-grammar-chars",
        type=int,
        default=limits.max_grammar_chars,
        help="longest regular expression or grammar a request may give as text; past it, 400",
    )
    add_chat_format_arguments(parser)
    add_model_pool_arguments(parser)
    parser.add_argument(
        "--request-body-timeout",
        type=float,
        default=30.0,
        help="seconds a request body may stall before the server answers 408",
    )
    parser.add_argument(
        "--responses-store-size",
        type=parse_bytes,
        default=256 << 20,
        help="memory kept for stored responses of the Responses API (e.g. 256MiB; the oldest "
        "go first past it)",
    )
    parser.add_argument(
        "--responses-store-ttl",
        type=float,
        default=86400.0,
        metavar="SECONDS",
        help="a stored response is forgotten this long after it was made (default 86400)",
    )
    parser.add_argument(
        "--metrics-require-key",
        action="store_true",
        help="with --api-key, /metrics needs the key too (/health never does)",
    )
    parser.add_argument(
        "--enable-api-docs",
        action="store_true",
        help="serve /docs and /openapi.json (off by default; they need the key like every route)",
    )
    parser.add_argument(
        "--no-console",
        dest="console",
        action="store_false",
        help="do not serve the console page at / and /console (nor /console/*)",
    )
    parser.add_argument(
        "--console-figures",
        metavar="DIR",
        action="append",
        type=Path,
        default=None,
        help="a directory of figures the console links, e.g. `quill bench serve --plot DIR`'s "
        "(repeatable; default: docs/figures/experiments, `quill bench experiments`' own)",
    )
    parser.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="name(s) clients use for the model (default: MODEL as given, or the default's name)",
    )
    parser.add_argument(
        "--api-core",
        choices=("auto", "shared", "own"),
        default="auto",
        help="own: the API process gets one core to itself, the engine process the others (as "
        "vLLM does on 2 vCPUs); shared: both run on every core; auto: what measured faster "
        "(docs/benchmarks.md)",
    )
    parser.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="disaggregation (quill router): prefill takes prompts in and hands their KV over "
        "at --kv-transfer-port; decode fetches it and writes the replies; both (default) "
        "serves whole requests only. Every role serves whole requests too.",
    )
    parser.add_argument(
        "--kv-lease",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="a prefill instance keeps a prompt's KV this long for its decode instance to "
        "fetch, then frees it (default 30)",
    )
    local = parser.add_mutually_exclusive_group()
    local.add_argument(
        "--disaggregate",
        metavar="P:D",
        default=None,
        help="start P prefill and D decode instances of this model on this machine, each "
        "pinned to its share of the cores, behind a router at --host:--port",
    )
    local.add_argument(
        "--data-parallel-size",
        "--replicas",
        dest="replicas",
        type=int,
        default=None,
        metavar="N",
        help="start N replicas of this model on this machine, each pinned to its share of the "
        "cores and publishing its KV-cache events, behind a router at --host:--port "
        "(--router-policy picks how it routes)",
    )
    parser.add_argument(
        "--data-parallel-backend",
        choices=("local", "ray"),
        default="local",
        help="where --data-parallel-size replicas run: local (this machine, the default) or "
        "ray (a Ray Serve application on the Ray cluster at --ray-address: Ray places the "
        "replicas, quill's policy routes them; needs `pip install quill[ray]`)",
    )
    parser.add_argument(
        "--ray-address",
        default=os.environ.get("RAY_ADDRESS", "auto"),
        help="the Ray cluster's address for --data-parallel-backend ray (default: "
        "$RAY_ADDRESS, else the cluster this machine belongs to)",
    )
    parser.add_argument(
        "--cpus-per-replica",
        type=int,
        default=1,
        metavar="N",
        help="--data-parallel-backend ray: the CPUs each replica asks Ray for (and is pinned "
        "to on its node; default 1)",
    )
    from quill.router.app import add_policy_arguments

    add_policy_arguments(parser, prefix="router-")
    parser.add_argument("--seed", type=int, default=0, help="seed of unseeded sampling")
    parser.add_argument("--log-level", default="info", help="debug | info | warning | error")
    parser.add_argument("--no-access-log", action="store_true", help="do not log each request")


class QuillServer(DrainingServer):
    """One model's server: drains its engine on the first signal, exits when it dies."""

    def __init__(self, config: uvicorn.Config, ctx: ServerContext, announce: bool = True) -> None:
        super().__init__(config, announce)
        self.ctx = ctx
        ctx.engine.on_death = self._engine_died

    def _engine_died(self, message: str) -> None:
        # A second's grace: clients in flight read their error, health checks see the 503.
        self.exit_code = 1
        if self.loop is not None:
            self.loop.call_later(1.0, self.request_shutdown)

    def drain(self) -> None:
        self.ctx.engine.drain()

    def ready_lines(self) -> list[str]:
        names = ", ".join(self.ctx.served_model_names)
        lines = [f"quill: serving {names} at {self.base_url} (OpenAI API: {self.base_url}/v1)"]
        if self.ctx.console:
            lines.append(f"quill: console at {self.base_url}/ (open it in a browser)")
        return lines


def build_server(args: argparse.Namespace, announce: bool = True) -> QuillServer:
    """Load the engine (slow) and wrap it in an app and a server; nothing is bound yet."""
    from quill.config import EngineConfig
    from quill.server.engine_client import EngineClient

    options = engine_options(args)
    if args.role == "prefill" and options["kv_transfer_port"] is None:
        options["kv_transfer_port"] = args.port + 1 if args.port else free_port()
    config = EngineConfig(model=args.model, seed=args.seed, **options)
    engine = EngineClient(config, log_level=args.log_level, api_core=args.api_core)
    info = engine.start_process()
    names = args.served_model_name or [args.model or Path(info.model_path).name]
    ctx = make_context(args, engine, names)
    config = uvicorn.Config(
        build_app(ctx),
        host=args.host,
        port=args.port,
        log_level=args.log_level.lower(),
        access_log=not args.no_access_log,
        lifespan="on",
        timeout_graceful_shutdown=10,  # a backstop: drained streams end within one step
        timeout_keep_alive=5,
    )
    return QuillServer(config, ctx, announce)


def make_context(args: argparse.Namespace, engine, names: list[str]) -> ServerContext:
    """What every route of one model's app needs, from `quill serve`'s flags and its started
    engine (`engine.info` set)."""
    from quill.server.metrics import ServerMetrics

    info = engine.info
    metrics = ServerMetrics(names[0])
    engine.metrics = metrics
    config = engine.config
    metrics.set_cache_config(config.block_size, info.num_kv_tokens // config.block_size,
                             config.enable_prefix_caching, config.kv_cache_dtype)  # fmt: skip
    return ServerContext(
        engine=engine,
        metrics=metrics,
        served_model_names=names,
        api_key=args.api_key or None,
        max_queued_requests=args.max_queued_requests,
        max_seqs_per_request=args.max_seqs_per_request,
        max_prompt_logprobs_tokens=args.max_prompt_logprobs_tokens,
        max_request_bytes=args.max_request_bytes,
        json_limits=JsonLimits(
            args.max_json_depth,
            args.max_json_values,
            args.max_schema_refs,
            args.max_grammar_chars,
        ),  # fmt: skip
        request_body_timeout=args.request_body_timeout,
        responses_store_bytes=args.responses_store_size,
        responses_store_ttl=args.responses_store_ttl,
        metrics_require_key=args.metrics_require_key,
        enable_api_docs=args.enable_api_docs,
        role=args.role,
        kv_lease_s=args.kv_lease,
        console=args.console,
        console_figures=args.console_figures or list(DEFAULT_FIGURE_DIRS),
        chat_format=chat_format_of(args, engine.tokenizer),
        pooling=(pooling := PoolingConfig.read(info.model_path, info.encoder)),
        scorer=scorer_for(info.task, engine.tokenizer, pooling, info.cross_encoder),
    )


def add_chat_format_arguments(parser: argparse.ArgumentParser) -> None:
    """How the model's conversations are written and its replies read (vLLM's flag names)."""
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSERS,
        default="auto",
        help="the model's tool-call format: auto (chosen from the chat template and logged; "
        "generic for a template that renders no tools), hermes (Qwen2.5/3), llama3_json, "
        "mistral, generic (quill's JSON shape)",
    )
    parser.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM command lines: quill always serves tool_choice auto",
    )
    parser.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSERS,
        default="auto",
        help="where the reply's thinking is split off into reasoning_content: auto (from the "
        "chat template), qwen3, deepseek_r1, none",
    )
    parser.add_argument(
        "--default-chat-template-kwargs",
        type=json.loads,
        default=None,
        help="chat template arguments every request gets unless it sets them, as JSON (e.g. "
        "'{\"enable_thinking\": false}')",
    )


def chat_format_of(args: argparse.Namespace, tokenizer) -> ChatFormat:
    """The chat format the flags and the model's template decide."""
    kwargs = args.default_chat_template_kwargs
    if kwargs is not None and not isinstance(kwargs, dict):
        raise SystemExit("--default-chat-template-kwargs must be a JSON object")
    return ChatFormat.choose(tokenizer.hf.chat_template, args.tool_call_parser,
                             args.reasoning_parser, kwargs)  # fmt: skip


def run_serve(args: argparse.Namespace) -> int:
    """Entry point of `quill serve`; returns the process exit code."""
    flags = ("max_queued_requests", "max_seqs_per_request", "max_prompt_logprobs_tokens",
             "max_request_bytes", "max_json_depth", "max_json_values", "max_schema_refs",
             "max_grammar_chars", "responses_store_size", "responses_store_ttl")  # fmt: skip
    for flag in flags:
        value = getattr(args, flag)
        if value is not None and value < 1:
            name = flag.replace("_", "-")
            print(f"quill serve: --{name} must be at least 1", file=sys.stderr)
            return 2
    if not args.kv_lease > 0:
        print("quill serve: --kv-lease must be positive seconds", file=sys.stderr)
        return 2
    if args.role != "prefill" and args.kv_transfer_port is not None:
        print("quill serve: --kv-transfer-port is a prefill instance's (--role prefill)",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.request_body_timeout <= 0:
        print("quill serve: --request-body-timeout must be positive", file=sys.stderr)
        return 2
    if args.data_parallel_backend == "ray" and not args.replicas:
        print("quill serve: --data-parallel-backend ray needs --data-parallel-size",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.disaggregate or args.replicas:
        if args.role != "both":
            print("quill serve: --role is per instance; --disaggregate sets it", file=sys.stderr)
            return 2
        if args.replicas is not None and args.replicas < 1:
            print("quill serve: --replicas must be at least 1", file=sys.stderr)
            return 2
        if args.data_parallel_backend == "ray":
            return _run_ray(args)
        from quill.router.local import parse_split, run_local

        try:
            if args.disaggregate:
                parse_split(args.disaggregate)
        except ValueError as e:
            print(f"quill serve: {e}", file=sys.stderr)
            return 2
        return run_local(args, getattr(args, "argv", [])[1:])
    if is_multi_model(args):
        if args.served_model_name or args.role != "both":
            print("quill serve: with --model / --model-dir each model is named by its flag "
                  "and serves whole requests (no --served-model-name, no --role)",
                  file=sys.stderr)  # fmt: skip
            return 2
        try:
            server = build_multi_server(args)
        except ValueError as e:
            print(f"quill serve: {e}", file=sys.stderr)
            return 2
        server.run()
        return server.exit_code if server.started else 1
    print(f"quill: loading {args.model or 'the default model (SmolLM2-135M-Instruct)'} ...")
    try:
        server = build_server(args)
    except RuntimeError as e:
        print(f"quill serve: {e}", file=sys.stderr)
        return 1
    server.run()
    if not server.started:
        return 1
    return server.exit_code


def _run_ray(args) -> int:
    try:
        from quill.router.ray_serve import run_ray
    except ImportError as e:
        print(f"quill serve: --data-parallel-backend ray needs Ray Serve ({e}): "
              "pip install 'quill[ray]'", file=sys.stderr)  # fmt: skip
        return 2
    from quill.router.local import instance_argv

    return run_ray(args, instance_argv(getattr(args, "argv", [])[1:]))
