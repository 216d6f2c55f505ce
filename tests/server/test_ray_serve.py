"""quill as a Ray Serve application on a local Ray cluster (`ray start --head` on the loopback
address), two replicas: `quill serve --data-parallel-size 2 --data-parallel-backend ray`.

Ray Serve (`pip install quill[ray]`) is installed by `make test` into a venv of its own that
sees quill's (.venv-ray: it brings uvloop and httptools, which uvicorn would otherwise pick up
in quill's own servers); the app runs under that venv's Python. Checked with the openai
client: replies equal a plain quill server's, the cache-aware request router sends a tenant's
later requests where its long system prompt is cached, a bad request gets the replica's 400,
and a replica whose server is killed mid-stream ends that stream with an error at once while
the next requests are served. Skipped, with Ray's words, where Ray cannot start a cluster.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import SERVER_ARGS
from server_helpers import API_KEY

from quill.distributed.ports import free_port

REPO = Path(__file__).resolve().parents[2]
RAY_BIN = Path(os.environ.get("QUILL_RAY_VENV", REPO / ".venv-ray")) / "bin"
ARGS = [a for i, a in enumerate(SERVER_ARGS) if a != "--port" and SERVER_ARGS[i - 1] != "--port"]


@pytest.fixture(scope="module")
def ray_address():
    if not (RAY_BIN / "ray").is_file():
        pytest.fail(f"Ray Serve is not installed at {RAY_BIN.parent}: run `make ray`")
    temp = tempfile.mkdtemp(prefix="rq", dir="/tmp")  # short: Ray's socket paths are bounded
    port = free_port()
    cmd = [str(RAY_BIN / "ray"), "start", "--head", "--node-ip-address", "127.0.0.1",
           "--port", str(port), "--num-cpus", "2", "--temp-dir", temp,
           "--include-dashboard", "false", "--disable-usage-stats",
           "--object-store-memory", str(100 * 2**20)]  # fmt: skip
    started = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if started.returncode != 0:
        shutil.rmtree(temp, ignore_errors=True)
        pytest.skip(f"Ray cannot start a local cluster here: {started.stderr[-800:]}")
    try:
        yield f"127.0.0.1:{port}"
    finally:
        subprocess.run([str(RAY_BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_app(ray_address):
    port = free_port()
    cmd = [str(RAY_BIN / "python"), "-m", "quill.cli", "serve", *ARGS, "--port", str(port),
           "--data-parallel-size", "2", "--data-parallel-backend", "ray",
           "--ray-address", ray_address]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    deadline = time.monotonic() + 300
    try:
        while not any("quill: ready" in line for line in lines):
            assert proc.poll() is None, "".join(lines[-60:])
            assert time.monotonic() < deadline, "".join(lines[-60:])
            time.sleep(0.2)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # it removes the app from the cluster
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def test_ray_serve_routes_by_cached_prefix_and_replies_as_quill(ray_app, client, model_name):
    through = _client(ray_app)
    tenants = {
        name: f"You are the assistant of {name}. " + f"{name} sells many things. " * 30
        for name in ("Acme", "Globex", "Initech")
    }
    placed = {name: [] for name in tenants}
    cached = {name: [] for name in tenants}
    for i in range(3):
        for name, system in tenants.items():
            messages = [{"role": "system", "content": system},
                        {"role": "user", "content": f"Question number {i}?"}]  # fmt: skip
            raw = through.chat.completions.with_raw_response.create(
                model=model_name, messages=messages, max_tokens=6, temperature=0
            )
            reply = raw.parse()
            own = client.chat.completions.create(model=model_name, messages=messages,
                                                 max_tokens=6, temperature=0)  # fmt: skip
            assert reply.choices[0].message.content == own.choices[0].message.content
            placed[name].append(raw.headers["x-quill-replica"])
            details = reply.usage.prompt_tokens_details
            cached[name].append(details.cached_tokens if details else 0)
    # Every later request of a tenant went where its first went and found its system prompt
    # there; the tenants were spread over both replicas.
    for name in tenants:
        assert len(set(placed[name])) == 1, (name, placed[name])
        assert cached[name][0] == 0 and all(c >= 128 for c in cached[name][1:]), cached
    assert len({p[0] for p in placed.values()}) == 2, placed
    messages = [{"role": "user", "content": "Count to five."}]
    stream = through.chat.completions.create(
        model=model_name, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    own = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8,
                                         temperature=0)  # fmt: skip
    assert text == own.choices[0].message.content
    assert [m.id for m in through.models.list().data] == [model_name]


def test_ray_serve_passes_the_replicas_errors_and_request_ids(ray_app, model_name):
    through = _client(ray_app)
    with pytest.raises(openai.BadRequestError) as bad:
        through.chat.completions.create(model=model_name, messages=[], max_tokens=4)
    assert bad.value.body["type"] == "invalid_request_error"
    # A body nested past Python's recursion: the ingress (which reads it to route it) passes
    # it on, and the replica refuses it in OpenAI's shape.
    deep = httpx.post(f"{ray_app}/v1/chat/completions", content="[" * 100_000 + "]" * 100_000,
                      headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)  # fmt: skip
    assert deep.status_code in (400, 422) and "error" in deep.json(), deep.text
    with pytest.raises(openai.AuthenticationError):
        _client(ray_app).with_options(api_key="wrong").models.list()
    r = httpx.post(
        f"{ray_app}/v1/completions",
        json={"model": model_name, "prompt": "Hello", "max_tokens": 2},
        headers={"Authorization": f"Bearer {API_KEY}", "X-Request-Id": "mine-42"},
        timeout=60,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "mine-42"


def test_ray_backend_refuses_more_replicas_than_the_cluster_has_cpus(ray_address):
    cmd = [str(RAY_BIN / "python"), "-m", "quill.cli", "serve", "--data-parallel-size", "3",
           "--data-parallel-backend", "ray", "--ray-address", ray_address]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "3 replicas x 1 CPUs need 3 CPUs; the Ray cluster has 2" in done.stderr


def test_ray_backend_without_ray_says_what_to_install():
    """quill's own venv has no Ray (it lives in .venv-ray)."""
    cmd = [sys.executable, "-m", "quill.cli", "serve", "--data-parallel-size", "2",
           "--data-parallel-backend", "ray"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "pip install 'quill[ray]'" in done.stderr


def test_ray_serve_replica_killed_mid_stream(ray_app, model_name):
    """Last in the module: Ray replaces the replica in the background."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": model_name, "prompt": "Once upon a time", "max_tokens": 400,
            "ignore_eos": True, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{ray_app}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:  # fmt: skip
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        port = r.headers["x-quill-replica"].rsplit(":", 1)[1]
        pid = _server_pid(port)
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        rest = [line for line in lines if line.startswith("data: ")]
        ended = time.monotonic() - killed
    assert ended < 2.0, ended
    assert rest[-1] == "data: [DONE]" and "error" in rest[-2], rest[-3:]
    for _ in range(4):  # served on: by the other replica (or Ray's replacement)
        reply = httpx.post(f"{ray_app}/v1/completions", headers=headers, timeout=60,
                           json={**body, "max_tokens": 4, "stream": False})  # fmt: skip
        assert reply.status_code == 200, reply.text


def _server_pid(port: str) -> int:
    """The `quill serve` process listening on `port` (a replica's server)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"quill.cli" in argv and b"--port" in argv and port.encode() in argv:
            if argv[argv.index(b"--port") + 1] == port.encode():
                return int(entry.name)
    raise AssertionError(f"no quill server on port {port}")
