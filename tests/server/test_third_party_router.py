"""quill replicas behind a router that is not quill's: vLLM's router (PyPI `vllm-router`, a
Rust binary, unmodified, installed by `make test` into its own venv), cache-aware policy.

Its cache-aware policy keeps a tree of the token ids it routed where; it gets a request's
tokens from each replica's render endpoint or, where there is none (quill), from `POST
/tokenize`, and it checks replicas on `GET /health`. Through it, with the openai client: each
reply equals the replica's own reply to the same request, and a tenant's later requests find
its long system prompt cached (the router sent them where the first went).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
import openai
import pytest
from conftest import SERVER_ARGS, running_server
from server_helpers import wait_until

from quill.config import cache_dir
from quill.distributed.ports import free_port

ROUTER = Path(
    os.environ.get("QUILL_VLLM_ROUTER", cache_dir() / "peers/vllm-router/bin/vllm-router")
)
ARGS = [
    a
    for a in SERVER_ARGS
    if a not in ("--api-key", SERVER_ARGS[SERVER_ARGS.index("--api-key") + 1])
]


@pytest.fixture(scope="module")
def replicas_behind_vllm_router():
    if not ROUTER.is_file():
        pytest.fail(f"vLLM's router is not installed at {ROUTER}: run `make vllm-router`")
    with running_server(ARGS) as a, running_server(ARGS) as b:
        port = free_port()
        cmd = [str(ROUTER), "--worker-urls", a.base_url, b.base_url, "--policy", "cache_aware",
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
               "--worker-startup-check-interval", "1"]  # fmt: skip
        router = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        url = f"http://127.0.0.1:{port}"
        try:

            def up() -> bool:
                assert router.poll() is None, router.stdout.read()
                try:
                    return httpx.get(f"{url}/health", timeout=1).status_code == 200
                except httpx.HTTPError:
                    return False

            wait_until(up, timeout=60, interval=0.2)
            yield url, a, b
        finally:
            router.terminate()
            try:
                router.wait(10)
            except subprocess.TimeoutExpired:
                router.kill()


def test_replies_through_vllm_router_are_the_replicas_own(replicas_behind_vllm_router):
    url, a, b = replicas_behind_vllm_router
    through = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    direct = openai.OpenAI(base_url=f"{a.base_url}/v1", api_key="none", max_retries=0)
    model = a.ctx.model_name
    tenants = {
        name: f"You are the assistant of {name}. " + f"{name} sells many things. " * 30
        for name in ("Acme", "Globex")
    }
    cached = {name: [] for name in tenants}
    for i in range(3):
        for name, system in tenants.items():
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Question number {i}?"}]  # fmt: skip
            reply = through.chat.completions.create(model=model, messages=messages,
                                                    max_tokens=6, temperature=0)  # fmt: skip
            own = direct.chat.completions.create(model=model, messages=messages,
                                                 max_tokens=6, temperature=0)  # fmt: skip
            assert reply.choices[0].message.content == own.choices[0].message.content
            details = reply.usage.prompt_tokens_details
            cached[name].append(details.cached_tokens if details else 0)
    # Every later request of a tenant found its system prompt where the router sent it. (The
    # direct requests went to replica a too; b's hits are the router's doing alone.)
    for name, counts in cached.items():
        assert counts[0] == 0 and all(c >= 128 for c in counts[1:]), (name, counts)
    stream = through.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
        temperature=0, stream=True,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    own = direct.chat.completions.create(model=model, temperature=0, max_tokens=8,
        messages=[{"role": "user", "content": "Count to five."}])  # fmt: skip
    assert text == own.choices[0].message.content


def test_the_router_tokenized_through_quills_tokenize(replicas_behind_vllm_router):
    """vLLM's router asks each replica for a request's tokens: quill answers /tokenize in
    vLLM's shape (count, tokens), the same tokens its own chat rendering computes."""
    url, a, _ = replicas_behind_vllm_router
    messages = [{"role": "user", "content": "Hello"}]
    r = httpx.post(f"{a.base_url}/tokenize", json={"model": a.ctx.model_name, "messages": messages})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    body_ = {"model": a.ctx.model_name, "messages": messages, "max_tokens": 1}
    served = httpx.post(f"{url}/v1/chat/completions", timeout=60, json=body_)
    assert served.status_code == 200
    assert served.json()["usage"]["prompt_tokens"] == body["count"]
