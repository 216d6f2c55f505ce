"""A replica other stacks can route: vLLM's metric names, GET /v1/loads, KV-cache events.

The suite's server publishes its KV-cache events (tests/server/conftest.py). A ZeroMQ
subscriber written here from vLLM's framing (topic, 8-byte big-endian sequence number,
msgpack batch) and vLLM's struct declarations (tests/test_kv_events.py) reads them; block
hashes are recomputed from the prompt's tokens by the documented rule.
"""

from __future__ import annotations

import asyncio
import threading
import time

import msgspec
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import engine_call, wait_until

from quill.server.vllm_metrics import VLLM_NAMES
from tests.test_kv_events import VBatch, VBlockStored, documented_hashes

DECODE = msgspec.msgpack.Decoder(VBatch)


def families(http) -> dict:
    return {f.name: f for f in text_string_to_metric_families(http.get("/metrics").text)}


def test_vllm_names_carry_quills_values(client, http, model_name, server):
    prompt = "Counting slowly, in words: one, two, three, four, five, six, seven, eight, nine, ten,"
    for _ in range(2):  # the second finds the first's blocks cached
        client.completions.create(model=model_name, prompt=prompt, max_tokens=3, temperature=0)
    wait_until(lambda: engine_call(server, "state")["num_running"] == 0)
    found = families(http)
    for quill_name, vllm_names in VLLM_NAMES.items():
        if f"quill:{quill_name}" not in found:
            continue  # a metric with no sample yet (spec decoding's, here)
        ours = {(s.name.removeprefix("quill:"), tuple(sorted(s.labels.items())), s.value)
                for s in found[f"quill:{quill_name}"].samples
                if not s.name.endswith("_created")}  # fmt: skip
        for name in vllm_names:
            theirs = found[f"vllm:{name}"]
            assert theirs.type == found[f"quill:{quill_name}"].type
            renamed = {(s.name.removeprefix("vllm:").replace(name, quill_name, 1),
                        tuple(sorted(s.labels.items())), s.value)
                       for s in theirs.samples if not s.name.endswith("_created")}  # fmt: skip
            assert renamed == ours, name
    # Against the engine's own state (quiet now).
    state = engine_call(server, "state")
    gauge = {n: found[n].samples[0].value for n in ("vllm:num_requests_running",
             "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")}  # fmt: skip
    assert gauge["vllm:num_requests_running"] == state["num_running"] == 0
    assert gauge["vllm:num_requests_waiting"] == state["num_waiting"] == 0
    assert gauge["vllm:kv_cache_usage_perc"] == state["kv_cache_usage"]
    queries = found["vllm:prefix_cache_queries"].samples[0].value
    hits = found["vllm:prefix_cache_hits"].samples[0].value
    assert (queries, hits) == (state["prefix_cache_queries"], state["prefix_cache_hits"])
    assert hits > 0  # the second request found the first one's blocks
    (info,) = found["vllm:cache_config_info"].samples
    assert info.labels["block_size"] == "16"
    assert int(info.labels["num_gpu_blocks"]) == state["kv_blocks_total"]
    assert info.labels["enable_prefix_caching"] == "True"


def test_loads_report_the_queues(client, http, model_name, server):
    report = http.get("/v1/loads").json()
    state = engine_call(server, "state")
    assert report["kv_blocks_total"] == state["kv_blocks_total"]
    assert report["block_size"] == 16
    assert report["kv_events"]["topic"] == "kv-events"
    engine_call(server, "pause")
    replies = []

    def send() -> None:
        replies.append(client.completions.create(model=model_name, prompt="Hello there",
                                                 max_tokens=2, temperature=0))  # fmt: skip

    threads = [threading.Thread(target=send) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        # The server counts them at once; the paused engine has not stepped.
        loads = wait_until(lambda: (r := http.get("/v1/loads").json())["requests_in_flight"] == 3
                           and r)  # fmt: skip
        assert loads["running"] == 0
    finally:
        engine_call(server, "resume")
    for t in threads:
        t.join(60)
    assert len(replies) == 3
    loads = wait_until(lambda: (r := http.get("/v1/loads").json())["requests_in_flight"] == 0
                       and r)  # fmt: skip
    state = engine_call(server, "state")
    assert (loads["running"], loads["waiting"]) == (0, 0)
    assert loads["kv_blocks_used"] == state["kv_blocks_used"]
    assert loads["num_tokens_in_flight"] == 0


@pytest.fixture
def subscriber(server):
    config = server.ctx.engine.config.kv_events
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode())
    sub.connect(config.endpoint)
    time.sleep(0.3)  # a subscription takes a moment to reach the publisher
    yield sub, config
    context.destroy(linger=0)


def _receive(sub, until, timeout: float = 30.0) -> list[tuple[int, bytes]]:
    got = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not sub.poll(200):
            continue
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events" and len(seq) == 8
        got.append((int.from_bytes(seq, "big"), payload))
        if until(got):
            return got
    raise AssertionError(f"the events expected did not come ({len(got)} batches)")


def test_events_name_a_prompts_blocks(client, model_name, server, subscriber):
    sub, config = subscriber
    tokens = [1000 + (i * 37) % 5000 for i in range(70)]  # 4 full blocks of 16, and 6 more
    expected = documented_hashes(tokens, 16)

    def stored(got) -> list[bytes]:
        hashes = []
        for _, payload in got:
            for event in DECODE.decode(payload).events:
                if isinstance(event, VBlockStored):
                    hashes += event.block_hashes
        return hashes

    client.completions.create(model=model_name, prompt=tokens, max_tokens=2, temperature=0)
    got = _receive(sub, lambda got: set(expected) <= set(stored(got)))
    hashes = stored(got)
    start = hashes.index(expected[0])
    assert hashes[start : start + 4] == expected
    seqs = [s for s, _ in got]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))), "numbers without gaps"
    batch = DECODE.decode(got[-1][1])
    assert batch.ts == pytest.approx(time.time(), abs=60)

    # Replay: the batches from a number on, as the replay socket keeps them, then the end.
    context = zmq.Context()
    try:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(config.replay_endpoint)
        dealer.send_multipart([b"", seqs[0].to_bytes(8, "big")])
        replayed = []
        while True:
            assert dealer.poll(5000), "no answer from the replay socket"
            empty, topic, seq, payload = dealer.recv_multipart()
            number = int.from_bytes(seq, "big", signed=True)
            if number == -1:
                assert payload == b""
                break
            replayed.append((number, payload))
        assert replayed[: len(got)] == got
    finally:
        context.destroy(linger=0)


def test_a_router_index_follows_the_replica(client, model_name, server):
    """quill's router's index of a replica, built from its events, holds what the engine's
    prefix cache holds after traffic."""
    from quill.router.kv_index import ReplicaBlocks, follow_events

    report = server.ctx.engine.config.kv_events
    blocks = ReplicaBlocks()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    address = {"endpoint": report.endpoint, "replay_endpoint": report.replay_endpoint,
               "topic": report.topic}  # fmt: skip
    task = asyncio.run_coroutine_threadsafe(follow_events(blocks, server.base_url, address), loop)
    try:
        time.sleep(0.3)
        prompt = [2000 + i for i in range(48)]
        client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
        wait_until(lambda: blocks.matched(documented_hashes(prompt, 16), 0.0) == 3)
        # It joined late: replayed from the start of the replica's buffer, so it knows the
        # earlier tests' blocks too, exactly as many as the engine still caches.
        state = engine_call(server, "state")
        assert blocks.num_batches > 0
        if blocks.last_seq < report.buffer_steps:  # the buffer reaches back to the start
            assert len(blocks.held) == state["prefix_cached_blocks"]
        else:
            assert len(blocks.held) <= state["prefix_cached_blocks"]
    finally:
        task.cancel()
        loop.call_soon_threadsafe(loop.stop)
