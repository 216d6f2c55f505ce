"""Tensor parallelism (quill/distributed): the same tokens and logits as one rank, on gloo.

Every variant runs at TP=1, 2 and 3 in fp32 and is held against TP=1, which the parity tests
hold against transformers: random Llama checkpoints whose heads divide 2 and 3 (12 query heads,
6 KV heads), one with a single KV head (replicated on every rank), a Qwen2 one with q/k/v
biases, and SmolLM2-135M itself at TP=3 (9 query heads, 3 KV heads). Then the failures: a rank
killed between steps, a size the model cannot split.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from quill import LLM, SamplingParams
from quill.contract.errors import ExecutorFailedError, ModelLoadError
from tests.conftest import write_random_checkpoint

PROMPTS = [[11, 12, 13, 14], [500] * 40, list(range(1000, 1077))]  # 77: several blocks
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True, logprobs=3)


def _engine(path: str, tp: int, **options) -> LLM:
    options = {"kv_cache_memory": 32 << 20, **options}
    return LLM(
        path,
        dtype="float32",
        kv_cache_dtype="float32",
        quantization="none",
        tensor_parallel_size=tp,
        **options,
    )


def _run(llm: LLM) -> list[tuple[list[int], list[dict[int, float]]]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        for mine, theirs in zip(logprobs, want_logprobs, strict=True):
            assert mine.keys() == theirs.keys()
            for token, value in theirs.items():
                assert mine[token] == pytest.approx(value, abs=2e-4)


# Each shape at one size (the default model is checked at 3 ranks below, two nodes at 2):
# 3 ranks split 12 query / 6 KV heads 4 / 2, 2 ranks replicate a lone KV head.
VARIANTS = {
    "llama, 12 query / 6 KV heads": ("llama", 12, 6, 3),
    "llama, one KV head (replicated)": ("llama", 6, 1, 2),
    "qwen2, q/k/v biases": ("qwen2", 12, 6, 2),
    "qwen3, q/k norms": ("qwen3", 12, 6, 3),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp_matches_one_rank(variant, tmp_path, model_dir):
    *shape, size = VARIANTS[variant]
    path = write_random_checkpoint(tmp_path, model_dir, *shape)
    with _engine(path, 1) as one:
        want = _run(one)
    for tp in (size,):
        with _engine(path, tp) as llm:
            got = _run(llm)
            processes = llm.engine.worker.runner.processes
            assert len(processes) == tp - 1 and all(p.is_alive() for p in processes)
        _assert_same(got, want)
        assert not any(p.is_alive() for p in processes)  # close() leaves no rank behind


def test_default_model_at_tp3_matches_one_rank(llm, model_dir):
    want = _run(llm)  # the suite's one-rank fp32 engine
    with _engine(str(model_dir), 3, kv_cache_memory=64 << 20) as three:
        layer = three.engine.worker.runner.runner.model.layers[0]
        assert (layer.num_heads, layer.num_kv_heads) == (3, 1)  # rank 0's slice of 9 and 3
        _assert_same(_run(three), want)


def test_a_size_that_cannot_split_is_refused_before_starting(model_dir, tmp_path):
    with pytest.raises(ModelLoadError, match=r"9 query heads do not divide among 2 ranks"):
        _engine(str(model_dir), 2)
    config = json.loads((model_dir / "config.json").read_text())
    config |= {"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4,
               "num_experts_per_tok": 2, "moe_intermediate_size": 64}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="experts is not supported"):
        _engine(str(tmp_path), 2, load_format="dummy", tokenizer=str(model_dir))


def _fails_within(llm: LLM, seconds: float, signum: int, rank: int = 1) -> None:
    """Signal a rank while the engine generates; the generate must raise in `seconds`."""
    import threading

    proc = llm.engine.worker.runner.processes[rank - 1]
    long = SamplingParams(max_tokens=400, temperature=0, ignore_eos=True)
    timer = threading.Timer(0.3, os.kill, (proc.pid, signum))  # mid-run: most likely mid-step
    start = time.monotonic()
    timer.start()
    try:
        with pytest.raises(ExecutorFailedError, match="tensor-parallel"):
            llm.generate(PROMPTS * 4, long, use_tqdm=False)
    finally:
        timer.cancel()
    assert time.monotonic() - start < seconds


def test_a_rank_killed_mid_run_fails_the_engine_at_once(tmp_path, model_dir):
    path = write_random_checkpoint(tmp_path, model_dir, "llama", 12, 6)
    llm = _engine(path, 2)
    processes = llm.engine.worker.runner.processes
    try:
        _fails_within(llm, 10, signal.SIGKILL)
    finally:
        llm.close()
    assert not any(p.is_alive() for p in processes)
    # Rank 0's group is gone with it: another engine can start in this process.
    with _engine(path, 2) as again:
        assert _run(again)


def test_a_rank_that_hangs_is_given_up_on_after_the_timeout(tmp_path, model_dir):
    path = write_random_checkpoint(tmp_path, model_dir, "llama", 12, 6)
    llm = _engine(path, 3, distributed_timeout=3.0)
    processes = llm.engine.worker.runner.processes
    try:
        _fails_within(llm, 3.0 + 15, signal.SIGSTOP, rank=2)
    finally:
        llm.close()  # kills the stopped rank
    assert not any(p.is_alive() for p in processes)


def _tp_node(path: str, port: int, pool: str):
    """`quill tp-node` as node 1 of 2 (rank 1 of 2) for rank 0's group at `port`."""
    import subprocess
    import sys

    flags = ["--tensor-parallel-size", "2", "--nnodes", "2", "--node-rank", "1",
             "--master-port", str(port), "--dtype", "float32", "--kv-cache-dtype", "float32",
             "--quantization", "none", "--kv-cache-memory", pool]  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "quill.cli", "tp-node", path, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_two_nodes_on_one_host_match_one_rank(tmp_path, model_dir):
    """--nnodes 2: node 1 runs `quill tp-node` with the same flags and joins rank 0's group at
    --master-addr/--master-port (both hosts are this one here); a node started with other
    options is refused."""
    from quill.distributed.group import free_port

    path = write_random_checkpoint(tmp_path, model_dir, "llama", 12, 6)
    with _engine(path, 1) as one:
        want = _run(one)
    port = free_port()
    node = _tp_node(path, port, "32MiB")
    try:
        with _engine(path, 2, nnodes=2, master_port=port) as llm:
            assert llm.engine.worker.runner.processes == []  # rank 1 is the other node's
            got = _run(llm)
        assert node.wait(30) == 0, node.stdout.read()
    finally:
        node.kill()
    _assert_same(got, want)

    port = free_port()  # a fresh group, and a node that would size its pool otherwise
    node = _tp_node(path, port, "16MiB")
    try:
        with pytest.raises(Exception):  # noqa: B017 - rank 0 learns only that rank 1 left
            _engine(path, 2, nnodes=2, master_port=port)
        assert node.wait(30) == 1
        assert "kv_cache_memory: 16777216 here, 33554432 at 0" in node.stdout.read()
    finally:
        node.kill()
