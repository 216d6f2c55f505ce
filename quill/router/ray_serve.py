"""quill as a Ray Serve application: replicas placed by Ray, routed by quill's policies.

    quill serve --data-parallel-size N --data-parallel-backend ray [--ray-address ADDR] ...
    serve run quill.router.ray_serve:build replicas=N serve_args="--max-model-len 4096"

The parts are Ray Serve's own:

- `QuillReplica`, a deployment of N replicas that Ray places on the cluster's nodes (each asks
  for `cpus_per_replica` CPUs): each starts a `quill serve` process on its node, pinned to
  cores it claims there, its KV-cache events on, and relays requests to it. Its metadata
  (Ray's `record_replica_metadata`) is that server's URL; Ray's health check fails, and Ray
  replaces the replica, when the server exits.
- `QuillRequestRouter`, that deployment's request router (Ray Serve's RequestRouter API):
  the policy objects of `quill router` (quill/router/policies.py, cache-aware by default) over
  the same per-replica state (quill/router/instances.py: each server's /v1/loads polled, its
  KV-cache events followed into the index of cached blocks).
- `QuillIngress`, the OpenAI-compatible HTTP ingress behind Ray Serve's proxy: it renders and
  tokenizes a chat or completion request as the replicas will (quill/router/prompt_blocks.py)
  and hands the tokens to the router with the request (Ray's own KV-aware router takes them
  the same way); every other route is relayed by load. Replies come back as they were
  written, streamed or whole, with `X-Request-Id` and `X-Quill-Replica` (the server's URL).

Ray is an optional extra (`pip install quill[ray]`); nothing else in quill imports this module.
"""

# No `from __future__ import annotations`: FastAPI reads the ingress's parameter types, which
# Ray Serve's ingress wrapper would leave as unresolvable strings.
import asyncio
import fcntl
import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import httpx
from fastapi import FastAPI, Request
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.responses import JSONResponse, Response, StreamingResponse

from quill.contract.errors import InvalidRequestError
from quill.distributed.ports import free_port
from quill.lifetime import child_setup
from quill.router.instances import WHOLE, Instance, Instances
from quill.router.local import model_path_for, wait_healthy
from quill.router.policies import CacheAware, CacheAwareSettings, make_policy
from quill.router.prompt_blocks import CHAT, COMPLETIONS, PromptBlocks, prefix_hashes

log = logging.getLogger(__name__)

APP_NAME = "quill"
PROMPT_KWARG = "quill_prompt"  # (token ids, cache salt): what the router hashes
_SEND_TRIES = 3  # a request whose replica's server refused it is sent again, twice at most
_RESEND_AFTER_S = 0.3
_RELAYED_HEADERS = ("authorization", "content-type", "accept", "x-request-id")
_STARTUP_WAIT_S = 30.0  # how long the router waits to see every replica it was deployed with


# Above the deployments: Ray Serve ships the ingress class by value, with the names it had.
async def _stream(reply):
    """A replica's event stream; an error event and the end if the replica is lost midway."""
    try:
        async for chunk in reply:
            yield chunk
    except Exception as e:  # noqa: BLE001
        event = _error_body(f"the replica failed mid-reply: {e}")
        yield b"data: " + event + b"\n\ndata: [DONE]\n\n"


def _error(message: str) -> dict:
    return {"error": {"message": message, "type": "server_error", "param": None, "code": None}}


def _error_body(message: str) -> bytes:
    return json.dumps(_error(message)).encode()


def claim_cores(n: int) -> tuple[set[int], list]:
    """`n` of this process's cores that no other replica on this node holds (a lock file per
    core, released when the process ends, however it ends); fewer if fewer are free, none
    (share them all) if none is. Ray counts CPUs but does not say which cores are whose."""
    lock_dir = os.path.join(tempfile.gettempdir(), "quill-cores")
    os.makedirs(lock_dir, exist_ok=True)
    held, files = set(), []
    for core in sorted(os.sched_getaffinity(0)):
        if len(held) == n:
            break
        f = open(os.path.join(lock_dir, f"{core}.lock"), "w")  # noqa: SIM115 (held open)
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            continue
        held.add(core)
        files.append(f)
    return held, files


class QuillReplica:
    """One replica: a `quill serve` process on this node, and a relay to it."""

    def __init__(self, serve_argv: list[str], cpus: int = 1, startup_timeout_s: float = 900):
        import ray

        host = ray.util.get_node_ip_address()
        self.cores, self._core_locks = claim_cores(cpus)
        events = {
            "enable_kv_cache_events": True,
            "endpoint": f"tcp://{host}:{free_port()}",
            "replay_endpoint": f"tcp://{host}:{free_port()}",
        }
        port = free_port()
        self.url = f"http://{host}:{port}"
        cmd = [sys.executable, "-m", "quill.cli", "serve", *serve_argv, "--host", host,
               "--port", str(port), "--kv-events-config", json.dumps(events),
               "--no-access-log"]  # fmt: skip
        log.info("quill replica: starting %s on cores %s", self.url, sorted(self.cores))
        # SIGTERM when this actor ends, however it ends: the server drains and stops.
        self.proc = subprocess.Popen(cmd, preexec_fn=child_setup(signal.SIGTERM, self.cores))
        try:
            wait_healthy(self.proc, self.url, time.monotonic() + startup_timeout_s)
        except RuntimeError:
            self.proc.terminate()
            raise
        # No timeout on a reply: a long one streams for minutes.
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0))

    def record_replica_metadata(self) -> dict:
        return {"url": self.url, "cores": sorted(self.cores)}

    def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the quill server {self.url} exited with {self.proc.returncode}")

    async def relay(self, method: str, path: str, body: bytes, headers: dict, **routing):
        """The server's reply: first {"status", "content_type", "replica"}, then its body in
        chunks. `routing` (the prompt's tokens) was for the router only."""
        sent_head = False
        try:
            async with self.client.stream(
                method, self.url + path, content=body, headers=headers
            ) as r:
                content_type = r.headers.get("content-type", "application/json")
                yield {"status": r.status_code, "content_type": content_type, "replica": self.url}
                sent_head = True
                async for chunk in r.aiter_raw():
                    yield chunk
        except httpx.HTTPError as e:
            if sent_head:
                raise RuntimeError(f"the quill server {self.url} failed mid-reply: {e}") from e
            # Refused: nothing was sent, so the ingress may send it again (elsewhere, once the
            # router has seen this server down).
            refused = isinstance(e, httpx.ConnectError)
            yield {"status": 503, "content_type": "application/json", "replica": self.url,
                   "refused": refused}  # fmt: skip
            yield _error_body(f"the quill server {self.url} failed: {e}")

    def __del__(self) -> None:
        proc = getattr(self, "proc", None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()


class QuillRequestRouter(RequestRouter):
    """Ray Serve's request router for QuillReplica: quill's policy on quill's replica state."""

    def initialize_state(
        self,
        policy: str = "cache-aware",
        cache_threshold: float = 0.3,
        balance_abs: float = 16.0,
        balance_rel: float = 1.5,
        poll_s: float = 0.25,
        num_replicas: int = 1,
    ) -> None:
        settings = CacheAwareSettings(cache_threshold, balance_abs, balance_rel)
        self.policy = make_policy(policy, settings)
        self.instances = Instances({WHOLE: []}, poll_s=poll_s)
        self._of_replica: dict[ReplicaID, Instance] = {}
        self._hashes: dict[str, list[bytes]] = {}  # a request's blocks, until it is routed
        self._client: httpx.AsyncClient | None = None
        # Ray's handle learns of running replicas one update at a time, so its first
        # requests may see one replica of several; each would then be placed there (and a
        # tenant's later requests follow its cache). Until all have been seen, a request waits.
        self._num_replicas = num_replicas
        self._seen: set[ReplicaID] = set()
        self._wait_until = time.monotonic() + _STARTUP_WAIT_S

    def _starting(self, candidates: list[RunningReplica]) -> bool:
        """Whether some replica the deployment started with is still unseen (for at most
        _STARTUP_WAIT_S after the router starts)."""
        if len(self._seen) >= self._num_replicas:
            return False
        self._seen.update(r.replica_id for r in candidates)
        return len(self._seen) < self._num_replicas and time.monotonic() < self._wait_until

    async def _instance(self, replica: RunningReplica) -> Instance | None:
        """The state of a replica (its load read once when first seen); None until Ray has
        its metadata."""
        instance = self._of_replica.get(replica.replica_id)
        if instance is None:
            url = replica.replica_metadata.get("url")
            if not url:
                return None
            if self._client is None:  # made here: this is the router's event loop
                self._client = httpx.AsyncClient()
                self.instances.start(self._client)
            instance = self._of_replica[replica.replica_id] = Instance(url, WHOLE)
            self.instances.all.append(instance)
            await self.instances.poll(self._client, instance)
        return instance

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if self._starting(candidate_replicas):
            # Ray asks again at once (no backoff on a first pass), with its latest view of
            # the replicas: the sleep lets that view's update in.
            await asyncio.sleep(0.05)
            return []
        known = [(r, await self._instance(r)) for r in candidate_replicas]
        known = [(r, i) for r, i in known if i is not None]
        if not known:
            return [candidate_replicas]
        up = [(r, i) for r, i in known if i.healthy] or known
        hashes = self._prompt_hashes(pending_request, up[0][1].block_size)
        chosen = self.policy.choose([i for _, i in up], hashes, time.monotonic())
        if pending_request is not None and hashes:
            self._hashes[pending_request.metadata.internal_request_id] = hashes
        first = [r for r, i in up if i is chosen]
        rest = [r for r in candidate_replicas if r not in first]
        return [first, rest] if rest else [first]

    def _prompt_hashes(self, pending: PendingRequest | None, block_size: int) -> list[bytes]:
        if pending is None or not isinstance(self.policy, CacheAware):
            return []
        prompt = pending.kwargs.get(PROMPT_KWARG)
        if not prompt:
            return []
        token_ids, salt = prompt
        return prefix_hashes(token_ids, block_size, salt)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result):
        """Counted on its replica at once, its blocks expected there (kv_index.py)."""
        hashes = self._hashes.pop(pending_request.metadata.internal_request_id, None)
        instance = self._of_replica.get(replica_id)
        if instance is not None:
            instance.num_sent += 1
            if hashes:
                instance.blocks.expect(hashes, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._hashes.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        instance = self._of_replica.pop(replica_id, None)
        if instance is not None:
            if instance.events_task is not None:
                instance.events_task.cancel()
            self.instances.all.remove(instance)


ingress_app = FastAPI(title="quill on Ray Serve")


@serve.ingress(ingress_app)
class QuillIngress:
    """The OpenAI-compatible front: every route relayed to a replica Ray's router picks."""

    def __init__(self, replicas, model: str | None) -> None:
        """`model`: the model's path, whose tokenizer and template give a request's tokens
        to the cache-aware router (None: it routes by load)."""
        self.replicas = replicas.options(stream=True)
        self.prompts = PromptBlocks(model) if model else None

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def relay(self, path: str, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _RELAYED_HEADERS}
        # Ray Serve's proxy names every request (the client's X-Request-Id, if it sent one)
        # and returns the name with the reply; the replica gets it too, echoes and logs it.
        headers.setdefault("x-request-id", f"req-{uuid.uuid4().hex}")
        path = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        routing = {}
        if self.prompts is not None and request.method == "POST" and path in (CHAT, COMPLETIONS):
            prompt = await asyncio.to_thread(self._prompt, path, body)
            if prompt is not None:
                routing[PROMPT_KWARG] = prompt
        for attempt in range(_SEND_TRIES):
            reply = self.replicas.relay.remote(request.method, path, body, headers, **routing)
            try:
                head = await reply.__anext__()
            except Exception as e:  # noqa: BLE001 (Ray's errors: no replica, replica died)
                return JSONResponse(_error(f"no replica answered: {e}"), status_code=503)
            if not head.get("refused") or attempt == _SEND_TRIES - 1:
                break
            # Its server is gone: the router's next poll (0.25 s) takes it out of the rotation.
            await asyncio.sleep(_RESEND_AFTER_S)
        out = {"X-Quill-Replica": head["replica"]}
        if not head["content_type"].startswith("text/event-stream"):
            try:  # whole: read all of it, so a replica lost midway is a clean 503
                content = b"".join([chunk async for chunk in reply])
            except Exception as e:  # noqa: BLE001
                return JSONResponse(_error(f"the replica failed: {e}"), 503, headers=out)
            return Response(content, head["status"], out, head["content_type"])
        return StreamingResponse(_stream(reply), head["status"], out, head["content_type"])

    def _prompt(self, path: str, body: bytes) -> tuple[list[int], str | None] | None:
        try:  # bounded: a body nested past the parser's recursion is refused, not a 500
            request = self.prompts.limits.parse_text(body.decode("utf-8"), "body", "the body")
        except (InvalidRequestError, ValueError):
            return None  # the replica answers it with its 400
        if not isinstance(request, dict):
            return None
        token_ids = self.prompts.token_ids(path, request)
        salt = request.get("cache_salt")
        return (token_ids, salt if isinstance(salt, str) else None) if token_ids else None


def build_app(
    serve_argv: list[str],
    replicas: int,
    cpus_per_replica: int = 1,
    policy: str = "cache-aware",
    settings: CacheAwareSettings | None = None,
    model_path: str | None = None,
):
    """The Ray Serve application: `replicas` QuillReplicas behind a QuillIngress."""
    s = settings or CacheAwareSettings()
    router = RequestRouterConfig(
        request_router_class=QuillRequestRouter,
        request_router_kwargs={"policy": policy, "cache_threshold": s.cache_threshold,
                               "balance_abs": s.balance_abs, "balance_rel": s.balance_rel,
                               "num_replicas": replicas},
    )  # fmt: skip
    replica = serve.deployment(QuillReplica).options(
        name="QuillReplica",
        num_replicas=replicas,
        ray_actor_options={"num_cpus": cpus_per_replica},
        # quill queues and admits requests itself: Ray should not turn them away first.
        max_ongoing_requests=4096,
        health_check_period_s=2.0,
        request_router_config=router,
    )
    ingress = serve.deployment(QuillIngress).options(
        name="QuillIngress", num_replicas=1, ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=8192,
    )  # fmt: skip
    tokenizer = model_path if policy == "cache-aware" else None
    return ingress.bind(replica.bind(serve_argv, cpus_per_replica), tokenizer)


def build(args: dict):
    """For `serve run quill.router.ray_serve:build replicas=2 serve_args="..."` (and Ray's
    config files): replicas, cpus_per_replica, policy, model (a quill model name or path),
    serve_args (the replicas' `quill serve` flags)."""
    argv = shlex.split(args.get("serve_args", ""))
    model = args.get("model")
    if model:
        argv += ["--model", model]
    return build_app(
        argv,
        int(args.get("replicas", 1)),
        int(args.get("cpus_per_replica", 1)),
        args.get("policy", "cache-aware"),
        model_path=model_path_for(model),
    )


def run_ray(args, serve_argv: list[str]) -> int:
    """`quill serve --data-parallel-size N --data-parallel-backend ray`: deploy the app on the
    Ray cluster at --ray-address, serve it at --host:--port until a signal, then remove it."""
    import ray

    from quill.router.app import policy_settings

    ray.init(address=args.ray_address, logging_level=logging.WARNING)
    needed = args.replicas * args.cpus_per_replica
    cpus = ray.cluster_resources().get("CPU", 0)
    if cpus < needed:
        print(f"quill serve: {args.replicas} replicas x {args.cpus_per_replica} CPUs need "
              f"{needed} CPUs; the Ray cluster has {cpus:g}", file=sys.stderr)  # fmt: skip
        return 2
    port = args.port or free_port()
    serve.start(http_options={"host": args.host, "port": port})
    app = build_app(
        serve_argv, args.replicas, args.cpus_per_replica, args.router_policy,
        policy_settings(args, "router-"), model_path_for(args.model),
    )  # fmt: skip
    print(f"quill: deploying {args.replicas} replicas on the Ray cluster", flush=True)
    serve.run(app, name=APP_NAME, route_prefix="/")
    print(f"quill: serving through Ray Serve at http://{args.host}:{port} (OpenAI API: /v1)")
    print("quill: ready (Ctrl-C to stop)", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    print("quill: removing the application from the Ray cluster", flush=True)
    serve.delete(APP_NAME)
    ray.shutdown()
    return 0
