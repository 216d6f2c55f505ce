"""One real server for the whole server suite, on a free port, plus the offline engine.

The server runs in-process (uvicorn in a thread, built by the same code as `quill serve`) so
that tests can also reach inside it to inject faults; tests/server/test_server_cli.py starts
the real command as a subprocess.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import API_KEY

from quill.contract.sampling_params import SamplingParams
from quill.frontend.tokenizer import Tokenizer
from quill.llm import LLM
from quill.server.serve import QuillServer, add_serve_arguments, build_server
from tests.chat_fixtures import family_model

SERVER_ARGS = [
    "--dtype", "float32",
    "--kv-cache-dtype", "float32",
    "--quantization", "none",
    "--kv-cache-memory", "256MiB",
    "--port", "0",
    "--api-key", API_KEY,
    "--max-queued-requests", "64",
    "--max-seqs-per-request", "32",
    "--max-prompt-logprobs-tokens", "1024",
    "--max-request-bytes", "1MiB",
    "--request-body-timeout", "2",
    "--enable-api-docs",
    "--log-level", "warning",
    "--no-access-log",
]  # fmt: skip


@pytest.fixture(scope="session")
def hardware_file(tmp_path_factory):
    """A hand-made spec of 'this machine' for the live cost metrics: 100 GFLOP/s, 10 GB/s."""
    from quill.cost.hardware import HardwareSpec

    path = tmp_path_factory.mktemp("hardware") / "cpu.json"
    HardwareSpec("test-cpu", {"float32": 1e11}, 1e10, 24e9, price_per_hour=36.0).save(path)
    return path


@contextmanager
def running_server(args: list[str]) -> Iterator[QuillServer]:
    """A server built from `quill serve` flags, run in a thread until the block ends."""
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    srv = build_server(parser.parse_args(args), announce=False)
    thread = threading.Thread(target=srv.run, name="test-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:
        assert thread.is_alive(), "the server thread died while starting"
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield srv
    srv.request_shutdown()
    thread.join(30)
    assert not thread.is_alive(), "the server did not shut down"


@pytest.fixture(scope="session")
def server(hardware_file) -> Iterator[QuillServer]:
    from quill.distributed.ports import free_port

    events = {  # KV-cache events for routers (tests/server/test_routable_replica.py)
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{free_port()}",
        "replay_endpoint": f"tcp://127.0.0.1:{free_port()}",
        "topic": "kv-events",
    }
    args = ["--hardware", str(hardware_file), "--kv-events-config", json.dumps(events)]
    with running_server(SERVER_ARGS + args) as srv:
        yield srv


@pytest.fixture(scope="session")
def base_url(server: QuillServer) -> str:
    return server.base_url


@pytest.fixture(scope="session")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def http(base_url: str) -> httpx.Client:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def model_name(server: QuillServer) -> str:
    return server.ctx.model_name


@pytest.fixture(scope="session")
def offline(llm) -> LLM:
    """The offline engine (tests/conftest.py's fp32 LLM): the reference for greedy outputs."""
    return llm


@pytest.fixture(scope="session")
def greedy(offline: LLM):
    """greedy(prompts or conversations, max_tokens, chat=False) -> offline texts, batched."""

    def run(inputs: list, max_tokens: int, chat: bool = False, **extra) -> list[str]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, **extra)
        if chat:
            outs = offline.chat(inputs, params, use_tqdm=False)
        else:
            outs = offline.generate(inputs, params, use_tqdm=False)
        return [o.outputs[0].text for o in outs]

    return run


@pytest.fixture
def scrape(http: httpx.Client):
    """scrape() -> {(sample name, frozenset(labels minus model_name)): value} from /metrics."""

    def run() -> dict:
        r = http.get("/metrics")
        assert r.status_code == 200
        values = {}
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                labels = frozenset((k, v) for k, v in s.labels.items() if k != "model_name")
                values[(s.name, labels)] = s.value
        return values

    return run


# A model in its own words (tests/chat_fixtures.py): a random-weight Qwen3-shaped model with the
# Qwen3 family's tokenizer and template, served with its tool and reasoning formats; shared by
# the suites of the APIs that read them (chat completions, responses, messages).
@pytest.fixture(scope="session")
def qwen3_server(tmp_path_factory):
    directory = family_model(tmp_path_factory.mktemp("qwen3-served"), "qwen3", "qwen3")
    args = [str(directory), *SERVER_ARGS, "--kv-cache-memory", "64MiB",
            "--tool-call-parser", "auto", "--reasoning-parser", "auto"]  # fmt: skip
    with running_server(args) as srv:
        yield srv


@pytest.fixture(scope="session")
def qwen3(qwen3_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{qwen3_server.base_url}/v1", api_key=API_KEY,
                         max_retries=0, timeout=120)  # fmt: skip


@pytest.fixture(scope="session")
def qwen3_tok(qwen3_server) -> Tokenizer:
    return qwen3_server.ctx.tokenizer
