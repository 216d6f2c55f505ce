"""Prefill on one engine, decode on another (quill/disagg): the decode engine's reply equals
one engine's, the prefill engine frees its lease once the blocks are fetched, and a prefill
engine gone before the fetch fails that request alone on the decode engine, within the
timeout, with no block leaked there."""

from __future__ import annotations

import dataclasses
import gc
import multiprocessing
import time
import weakref

import pytest

from quill import LLM, SamplingParams
from quill.contract.plan import RemoteKV
from quill.distributed.group import free_port

PROMPT = list(range(2000, 2043))  # 43 tokens: 2 full blocks and a partial one
EXACT = list(range(3000, 3032))  # 32: exactly 2 blocks
OPTIONS = dict(dtype="float32", kv_cache_dtype="float32", quantization="none")


def _engine(model_dir, **extra) -> LLM:
    return LLM(str(model_dir), kv_cache_memory=16 << 20, **OPTIONS, **extra)


def _finish(llm: LLM, request_id: str):
    while True:
        for out in llm.engine.step():
            if out.request_id == request_id and out.finished:
                return out


def _prefill_side(model_dir, port, prompts, queue, stay_s, lease_s):
    llm = _engine(model_dir, kv_transfer_port=port, kv_transfer_timeout=10.0)
    first = SamplingParams(max_tokens=1, temperature=0)
    for i, prompt in enumerate(prompts):
        llm.engine.add_request(prompt, first, f"p{i}", kv_lease_s=lease_s)
        queue.put(dataclasses.asdict(_finish(llm, f"p{i}").kv_transfer))
    kv = llm.engine.scheduler.kv
    deadline = time.monotonic() + stay_s
    while kv.leases and time.monotonic() < deadline:  # until the decode engine fetched them
        llm.engine.step()
        time.sleep(0.01)
    queue.put({"leases": len(kv.leases), "free": kv.pool.num_free_blocks, "all": kv.num_blocks})


def _start_prefill(model_dir, prompts, stay_s=60.0, lease_s=60.0):
    context = multiprocessing.get_context("spawn")
    queue, port = context.Queue(), free_port()
    args = (model_dir, port, prompts, queue, stay_s, lease_s)
    proc = context.Process(target=_prefill_side, args=args, daemon=True)
    proc.start()
    return proc, queue


def test_decode_after_prefill_elsewhere_matches_one_engine(llm, model_dir):
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [PROMPT, EXACT, PROMPT, EXACT]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    proc, queue = _start_prefill(model_dir, prompts)
    block_bytes = 30 * 2 * 3 * 16 * 64 * 4  # layers x (K + V) x KV heads x tokens x values x 4
    try:
        decode = _engine(model_dir)
        # The third prompt's 2 full blocks are in the decode engine's prefix cache by then
        # (from the first): only its partial block is sent; of the fourth, nothing.
        for i, (prompt, sent) in enumerate(zip(prompts, [3, 2, 1, 0])):
            remote = RemoteKV(**queue.get(timeout=120))
            assert remote.num_tokens == len(prompt) and remote.first_token_id == want[i][0]
            assert len(remote.block_ids) == -(-len(prompt) // 16)
            decode.engine.add_request(prompt, greedy, f"d{i}", remote_kv=remote)
            out = _finish(decode, f"d{i}")
            assert out.outputs[0].token_ids == want[i]
            assert out.metrics.kv_transfer_bytes == sent * block_bytes
            assert 0 < out.metrics.kv_transfer_s < 30
            assert out.metrics.num_cached_tokens == (32 if i >= 2 else 0)
        # The decode engine computed none of the prompts: its steps were all decodes.
        fetcher = decode.engine.worker.runner.kv_fetcher
        assert fetcher.num_fetched == 4 and fetcher.bytes_fetched == 6 * block_bytes
        assert decode.engine.core.num_kv_recomputes == 0
        # The prefill engine freed both leases once fetched: its pool is idle again.
        idle = queue.get(timeout=60)
        assert idle == {"leases": 0, "free": idle["all"], "all": idle["all"]}
    finally:
        proc.join(30)
        proc.kill()


def test_an_engine_let_go_frees_its_model(model_dir):
    """Nothing of an engine outlives it: the KV fetcher's thread, once started with every
    engine, held its runner (the model and the KV cache) for the life of the process."""
    llm = _engine(model_dir)
    llm.generate([PROMPT], SamplingParams(max_tokens=2), use_tqdm=False)
    runner = weakref.ref(llm.engine.worker.runner)
    del llm
    gc.collect()
    assert runner() is None


@pytest.fixture(scope="module")
def orphan(model_dir):
    """A lease whose prefill engine has exited unfetched."""
    proc, queue = _start_prefill(model_dir, [PROMPT], stay_s=0.0)
    remote = RemoteKV(**queue.get(timeout=120))
    queue.get(timeout=60)
    proc.join(30)
    return remote


def _run_beside_another(decode: LLM, remote: RemoteKV, max_tokens: int) -> dict:
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    decode.engine.add_request([5, 6, 7], greedy, "other")
    decode.engine.add_request(PROMPT, greedy, "orphan", remote_kv=remote)
    start = time.monotonic()
    outs = {}
    while decode.engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in decode.engine.step() if o.finished})
    assert time.monotonic() - start < 30  # bounded by the transfer timeout, never a hang
    assert outs["other"].outputs[0].finish_reason == "length"
    kv = decode.engine.scheduler.kv
    assert kv.pool.num_free_blocks == kv.num_blocks  # nothing of the orphan left
    return outs


def test_a_prefill_engine_gone_fails_only_that_request(model_dir, orphan):
    decode = _engine(model_dir, kv_transfer_timeout=3.0, kv_transfer_failure="fail")
    outs = _run_beside_another(decode, orphan, 4)
    assert outs["orphan"].outputs[0].finish_reason == "error"
    assert "KV transfer failed" in outs["orphan"].error
    assert decode.engine.core.num_kv_recomputes == 0


def test_a_prefill_engine_gone_is_recomputed_by_default(llm, model_dir, orphan):
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = llm.generate([PROMPT], greedy, use_tqdm=False)[0].outputs[0].token_ids
    decode = _engine(model_dir, kv_transfer_timeout=3.0)
    outs = _run_beside_another(decode, orphan, 6)
    # The first token is the prefill engine's; the rest follow from the prompt computed here.
    assert outs["orphan"].outputs[0].token_ids == want
    assert outs["orphan"].metrics.kv_transfer_bytes is None
    assert decode.engine.core.num_kv_recomputes == 1


def test_aborts_before_during_and_after_the_fetch_leave_both_pools_idle(model_dir):
    """Aborted before its fetch: the decode engine frees its blocks at once and the prefill
    engine its lease when the lease ends (3 s); aborted while its fetch runs: the decode
    engine keeps the blocks until the fetch ends (it writes them), then frees them; aborted
    after: both at once."""
    during_prompt = list(range(4000, 4200))  # 200 tokens: a fetch long enough to abort in
    proc, queue = _start_prefill(model_dir, [PROMPT, during_prompt, EXACT], stay_s=30.0,
                                 lease_s=3.0)  # fmt: skip
    try:
        decode = _engine(model_dir)
        kv = decode.engine.scheduler.kv
        fetcher = decode.engine.worker.runner.kv_fetcher
        greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        early, during, late = (RemoteKV(**queue.get(timeout=120)) for _ in range(3))
        decode.engine.add_request(PROMPT, greedy, "early", remote_kv=early)
        decode.engine.abort_request("early")
        decode.engine.add_request(during_prompt, greedy, "during", remote_kv=during)
        outs = {o.request_id: o for o in decode.engine.step()}  # "during"'s fetch starts
        assert outs["early"].finished and kv.pool.num_free_blocks < kv.num_blocks
        decode.engine.abort_request("during")
        decode.engine.add_request(EXACT, greedy, "late", remote_kv=late)
        deadline = time.monotonic() + 30
        while fetcher.num_fetched < 2:  # "during"'s fetch and "late"'s end, in order
            decode.engine.step()
            assert time.monotonic() < deadline
        while not decode.engine.scheduler.running:  # "late" joins once its fetch is collected
            decode.engine.step()
        decode.engine.abort_request("late")
        while decode.engine.has_unfinished_requests():
            decode.engine.step()
        assert kv.pool.num_free_blocks == kv.num_blocks
        idle = queue.get(timeout=60)  # once the prefill engine holds no lease
        assert idle == {"leases": 0, "free": idle["all"], "all": idle["all"]}
        assert fetcher.num_failed == 0
    finally:
        proc.join(30)
        proc.kill()


def test_remote_kv_must_fit_the_prompt(model_dir, llm):
    from quill.contract.errors import InvalidRequestError

    remote = RemoteKV("127.0.0.1", 1, "x", [0, 1], 20, 5)
    with pytest.raises(InvalidRequestError, match="holds 20 tokens, the prompt has 3"):
        llm.engine.add_request([1, 2, 3], SamplingParams(max_tokens=2), "bad", remote_kv=remote)
