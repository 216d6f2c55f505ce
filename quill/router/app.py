"""The router's HTTP app and `quill router`: the OpenAI routes, /health, /metrics, /v1/models.

Bodies are passed on as they came (each instance validates its own, so a bad request gets the
instance's 400); the router reads only what it needs to choose the route.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os

import httpx
import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from quill.contract.errors import InvalidRequestError
from quill.frontend.json_limits import DEFAULT_LIMITS
from quill.router.instances import DECODE, PREFILL, WHOLE, Instances
from quill.router.policies import POLICIES, CacheAwareSettings, make_policy
from quill.router.prompt_blocks import PromptBlocks
from quill.router.proxy import CHAT, COMPLETIONS, Router, error

log = logging.getLogger(__name__)


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "quill_router:requests", "Requests by route: split or whole.", ["route"], registry=r
        )
        self.failures = Counter(
            "quill_router:instance_failures",
            "Requests an instance failed to answer (connection lost, refused).",
            ["kind"],
            registry=r,
        )
        self.routed = Counter(
            "quill_router:routed",
            "Whole requests by instance and why the policy chose it (cached: its prefix is "
            "there; uncached / no blocks / imbalanced: by load; round-robin; least-load).",
            ["instance", "reason"],
            registry=r,
        )


def build_router_app(
    urls: dict[str, list[str]],
    poll_s: float = 0.25,
    policy: str = "least-load",
    model: str | None = None,
    settings: CacheAwareSettings | None = None,
    api_key: str | None = None,
) -> Starlette:
    """`urls`: instance URLs by kind (prefill, decode, whole). `policy` picks among whole
    instances (quill/router/policies.py); `model` (its path) lets the router see requests'
    prompts as the instances' prefix caches do, for the cache-aware policy. `api_key`: the
    instances' key, for the router's own calls (clients' requests carry theirs)."""
    if policy == "cache-aware" and model is None:
        log.warning("cache-aware routing without the model's tokenizer (--tokenizer): by load")
    instances = Instances(urls, poll_s, api_key=api_key)
    metrics = RouterMetrics()
    # No timeout on a reply: a long one streams for minutes; connections are bounded.
    client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=10.0))
    blocks = PromptBlocks(model) if model is not None and policy == "cache-aware" else None
    router = Router(instances, client, metrics, make_policy(policy, settings), blocks)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        # Every instance's load once before the first request.
        await asyncio.gather(*(instances.poll(client, i) for i in instances.all))
        instances.start(client)
        yield
        await instances.stop()
        await client.aclose()

    def proxy(path: str):
        async def endpoint(request: Request) -> Response:
            try:  # bounded: a body nested past the parser's recursion is a 400, not a 500
                text = (await request.body()).decode("utf-8")
                body = DEFAULT_LIMITS.parse_text(text, "body", "the body")
            except InvalidRequestError as e:
                return error(400, str(e), "invalid_request_error")
            except ValueError as e:  # not UTF-8
                return error(400, f"the body is not JSON: {e}", "invalid_request_error")
            if not isinstance(body, dict):
                return error(400, "the body must be a JSON object", "invalid_request_error")
            headers = {}
            for name in ("Authorization", "X-Request-Id"):  # the client's id is kept
                if name.lower() in request.headers:
                    headers[name] = request.headers[name.lower()]
            return await router.handle(path, body, headers)

        return endpoint

    async def health(request: Request) -> Response:
        down = [i.url for i in instances.all if not i.healthy]
        kinds = {i.kind for i in instances.all if i.healthy}
        serving = WHOLE in kinds or DECODE in kinds
        body = {"status": "ok" if serving else "unavailable", "unhealthy": down}
        return JSONResponse(body, status_code=200 if serving else 503)

    async def models(request: Request) -> Response:
        first = (instances.of(DECODE) or instances.of(WHOLE))[0]
        try:
            r = await client.get(f"{first.url}/v1/models", headers=dict(request.headers))
        except httpx.HTTPError as e:
            return error(503, f"the instance {first.url} failed: {e}")
        return Response(r.content, r.status_code, media_type="application/json")

    async def prometheus(request: Request) -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    routes = [
        Route(COMPLETIONS, proxy(COMPLETIONS), methods=["POST"]),
        Route(CHAT, proxy(CHAT), methods=["POST"]),
        Route("/v1/models", models),
        Route("/health", health),
        Route("/metrics", prometheus),
    ]
    app = Starlette(routes=routes, lifespan=lifespan)
    app.state.instances = instances
    return app


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                        help="prefill instances (quill serve --role prefill)")  # fmt: skip
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL",
                        help="decode instances (quill serve --role decode)")  # fmt: skip
    parser.add_argument("--whole", "--replica", nargs="+", default=[], metavar="URL",
                        help="replicas sent whole requests (data parallel; any role)")  # fmt: skip
    add_policy_arguments(parser)
    parser.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="the replicas' model (its path: a .gguf or a directory), whose "
                        "tokenizer and chat template the cache-aware policy reads prompts "
                        "with")  # fmt: skip
    parser.add_argument("--api-key", default=os.environ.get("QUILL_API_KEY"),
                        help="the instances' API key, for the router's polls of their load "
                        "(default: $QUILL_API_KEY)")  # fmt: skip
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default="info")


def add_policy_arguments(parser: argparse.ArgumentParser, prefix: str = "") -> None:
    """The routing policy's flags (`prefix`: "router-" where serve takes them)."""
    parser.add_argument(f"--{prefix}policy", choices=POLICIES, default="cache-aware",
                        help="how whole requests pick a replica: cache-aware (default: where "
                        "the prompt's prefix is cached, unless the loads are out of balance), "
                        "least-load (waiting x 4 + running) or round-robin")  # fmt: skip
    defaults = CacheAwareSettings()
    parser.add_argument(f"--{prefix}cache-threshold", type=float,
                        default=defaults.cache_threshold,
                        help="cache-aware: the share of a prompt's blocks a replica must hold "
                        "for the prefix to decide (default %(default)s)")  # fmt: skip
    parser.add_argument(f"--{prefix}balance-abs-threshold", type=float,
                        default=defaults.balance_abs,
                        help="cache-aware: loads out of balance when the highest exceeds the "
                        "lowest by this much (a waiting request counts 4, a running one 1; "
                        "default %(default)s) ...")  # fmt: skip
    parser.add_argument(f"--{prefix}balance-rel-threshold", type=float,
                        default=defaults.balance_rel,
                        help="... and by this factor (default %(default)s)")  # fmt: skip


def policy_settings(args: argparse.Namespace, prefix: str = "") -> CacheAwareSettings:
    p = prefix.replace("-", "_")
    return CacheAwareSettings(
        getattr(args, f"{p}cache_threshold"),
        getattr(args, f"{p}balance_abs_threshold"),
        getattr(args, f"{p}balance_rel_threshold"),
    )


def check_router_arguments(args: argparse.Namespace) -> str | None:
    """What is wrong with the instances asked for, or None."""
    if args.whole and (args.prefill or args.decode):
        return "--whole instances take every request: give them alone"
    if not args.whole and not args.decode:
        return "give --decode URL ... (and --prefill URL ...), or --whole URL ..."
    return None


def run_router(args: argparse.Namespace) -> int:
    """Entry point of `quill router`."""
    problem = check_router_arguments(args)
    if problem:
        print(f"quill router: {problem}", flush=True)
        return 2
    urls = {PREFILL: args.prefill, DECODE: args.decode, WHOLE: args.whole}
    app = build_router_app(
        urls,
        policy=args.policy,
        model=args.tokenizer,
        settings=policy_settings(args),
        api_key=args.api_key,
    )
    print(f"quill: router at http://{args.host}:{args.port} for {_describe(urls)}", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower())
    return 0


def _describe(urls: dict[str, list[str]]) -> str:
    return "; ".join(f"{kind} {' '.join(us)}" for kind, us in urls.items() if us)
