"""The KV link between a prefill and a decode instance (quill/disagg/transfer.py), on gloo.

A prefill process computes a prompt's KV into blocks of its pool and its first token, and
sends the blocks to each decode side that pairs; a decode side receives them into other block
ids of its own pool and decodes on from there. Its tokens and logprobs must be those of one
process doing it all (the same runner, the same weights, fp32). Then: a layout that differs is
refused on both sides with what differs; a peer that never comes is an error within the
timeout, not a hang.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from quill.contract.plan import SeqPlan, StepPlan
from quill.contract.sampling_params import SamplingParams

PROMPT = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 and a partial one
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=2)
STEPS = 6


def _runner(model_dir, kv_cache_dtype="float32"):
    from quill.config import EngineConfig
    from quill.model.factory import build_model_executor

    config = EngineConfig(
        str(model_dir),
        dtype="float32",
        kv_cache_dtype=kv_cache_dtype,
        quantization="none",
        kv_cache_memory=8 << 20,
    )
    return build_model_executor(config).runner


def _prefill(runner, table):
    plan = StepPlan(0, [SeqPlan("r", PROMPT, 0, len(PROMPT), [table], True, GREEDY)])
    return runner.execute(plan)


def _decode(runner, table, first):
    """STEPS decode steps after the prompt and `first`: the tokens and their logprobs."""
    tokens, logprobs, last = [], [], first
    for i in range(STEPS):
        start = len(PROMPT) + i
        plan = StepPlan(i + 1, [SeqPlan("r", [last], start, len(PROMPT), [table], True, GREEDY)])
        result = runner.execute(plan)
        last = result.sampled["r"][0]
        tokens.append(last)
        logprobs.append(result.logprobs["r"][0][0])
    return tokens, logprobs


def _prefill_side(model_dir, port, queue, kv_cache_dtype, num_peers=1):
    from quill.disagg.transfer import KVLayout, KVListener

    runner = _runner(model_dir, kv_cache_dtype)
    table = [5, 2, 9, 11]  # room for the prompt and the decode steps; not the decode side's ids
    first = _prefill(runner, table).sampled["r"][0]
    listener = KVListener("127.0.0.1", port, KVLayout.of(runner, "smol"), 20)
    for _ in range(num_peers):  # each decode instance pairs over its own link
        try:
            link = None
            while link is None:
                link = listener.accept(wait_s=1.0)
            payload = link.gather_blocks(runner.kv_caches, table[:3])
            queue.put(("sent", first, link.send_blocks(payload, len(PROMPT))))
        except Exception as e:  # noqa: BLE001 - the test reads what happened
            queue.put(("error", str(e), 0))


def _spawn(target, *args):
    proc = multiprocessing.get_context("spawn").Process(target=target, args=args, daemon=True)
    proc.start()
    return proc


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "int8"])
def test_decode_after_a_transfer_matches_one_process(model_dir, kv_cache_dtype):
    """Two decode instances (here two runners of this process) pair with one prefill
    instance, each over its own link, and each decodes what one process would (an int8
    cache's blocks carry their scales)."""
    from quill.disagg.transfer import KVLayout, connect
    from quill.distributed.group import free_port

    runner = _runner(model_dir, kv_cache_dtype)
    whole = [0, 1, 2, 3]
    first = _prefill(runner, whole).sampled["r"][0]
    want_tokens, want_logprobs = _decode(runner, whole, first)

    port = free_port()
    queue = multiprocessing.get_context("spawn").Queue()
    proc = _spawn(_prefill_side, model_dir, port, queue, kv_cache_dtype, 2)
    try:
        for table in ([7, 3, 10, 1], [0, 6, 4, 8]):
            fresh = _runner(model_dir, kv_cache_dtype)  # an empty pool: nothing of the prompt
            link = connect("127.0.0.1", port, KVLayout.of(fresh, "smol"), 20)
            assert link.recv_blocks(fresh.kv_caches, table[:3]) == len(PROMPT)
            kind, their_first, sent = queue.get(timeout=30)
            assert kind == "sent" and their_first == first
            # 3 blocks x 30 layers x (K + V) x 3 KV heads x 16 tokens x 64 values x 4 bytes
            # (int8: a byte each and a 2-byte scale per 32)
            per_value = {"float32": 4, "int8": 1 + 2 / 32}[kv_cache_dtype]
            assert sent == 3 * 30 * 2 * 3 * 16 * 64 * per_value
            tokens, logprobs = _decode(fresh, table, their_first)
            assert tokens == want_tokens
            # Each process times its float products at start-up and may pick another kernel
            # for them: last-bit differences in the keys, which int8 codes can round apart.
            bound = {"float32": 1e-4, "int8": 2e-2}[kv_cache_dtype]
            assert logprobs == pytest.approx(want_logprobs, abs=bound)
    finally:
        proc.join(30)
        proc.kill()


def test_a_layout_that_differs_is_refused_on_both_sides(model_dir):
    mine, theirs = "bfloat16", "int8"  # the cache types, each named
    from quill.disagg.transfer import KVLayout, TransferError, connect
    from quill.distributed.group import free_port

    port = free_port()
    queue = multiprocessing.get_context("spawn").Queue()
    proc = _spawn(_prefill_side, model_dir, port, queue, theirs)  # another cache there
    try:
        runner = _runner(model_dir, mine)
        with pytest.raises(TransferError, match=f"kv_cache_dtype: '{mine}' here, '{theirs}'"):
            connect("127.0.0.1", port, KVLayout.of(runner, "smol"), 20)
        kind, message, _ = queue.get(timeout=30)
        assert kind == "error" and f"kv_cache_dtype: '{theirs}' here, '{mine}' there" in message
    finally:
        proc.join(30)
        proc.kill()


def test_a_peer_that_never_comes_is_an_error_within_the_timeout(model_dir):
    from quill.disagg.transfer import KVLayout, TransferError, connect
    from quill.distributed.group import free_port

    runner = _runner(model_dir)
    start = time.monotonic()
    with pytest.raises(TransferError, match="no KV link"):
        connect("127.0.0.1", free_port(), KVLayout.of(runner, "smol"), 2)
    assert time.monotonic() - start < 10
    assert torch.distributed.is_initialized() is False  # the link is no default group
