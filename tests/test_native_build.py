"""The native build and its fallbacks: a second set-up compiles nothing; a failed build, a
missing library or `QUILL_NATIVE=0` leave quill serving on its PyTorch path, and say so."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from quill import SamplingParams
from quill.ops import library
from tests.conftest import NATIVE

GENERATE = """
import json, sys
from quill import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_dtype="float32", quantization="none",
          kv_cache_memory=64 << 20)
out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, temperature=0),
                   use_tqdm=False)
print(json.dumps(out[0].outputs[0].token_ids))
"""


def run_python(args: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], env={**os.environ, **env}, capture_output=True, text=True
    )


@pytest.fixture(scope="module")
def expected_tokens(llm):
    out = llm.generate(
        ["The capital of France is"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False
    )
    return out[0].outputs[0].token_ids


@pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")
def test_second_build_compiles_nothing():
    before = {isa: library.library_path(isa).stat().st_mtime for isa in library.runnable_isas()}
    proc = run_python(["-m", "quill.ops.build"], {})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(before) and all("up to date" in line for line in lines), lines
    after = {isa: library.library_path(isa).stat().st_mtime for isa in before}
    assert after == before


def test_failed_build_is_reported_and_quill_serves(tmp_path, model_dir, expected_tokens):
    if not library.runnable_isas():
        pytest.skip("this CPU runs no native library")
    env = {"QUILL_CACHE": str(tmp_path), "CXX": "/bin/false"}
    proc = run_python(["-m", "quill.ops.build"], env)
    assert proc.returncode == 0, proc.stderr  # set-up goes on
    assert "FAILED" in proc.stdout and "PyTorch path" in proc.stdout, proc.stdout
    assert not list(tmp_path.glob("ops/*/*.so"))
    served = run_python(["-c", GENERATE, str(model_dir)], {"QUILL_CACHE": str(tmp_path)})
    assert served.returncode == 0, served.stderr
    assert "not built" in served.stderr and "PyTorch path" in served.stderr, served.stderr
    assert json.loads(served.stdout.strip().splitlines()[-1]) == expected_tokens


def test_quill_native_0_serves_on_the_pytorch_path(model_dir, expected_tokens):
    served = run_python(["-c", GENERATE, str(model_dir)], {"QUILL_NATIVE": "0"})
    assert served.returncode == 0, served.stderr
    assert "QUILL_NATIVE=0" in served.stderr and "attention: PyTorch path" in served.stderr
    assert json.loads(served.stdout.strip().splitlines()[-1]) == expected_tokens


def test_unrunnable_isa_is_refused(monkeypatch):
    monkeypatch.setenv("QUILL_NATIVE_ISA", "avx9000")
    assert library._choose_isa() is None
    assert library.runnable_isas(frozenset({"avx2", "fma"})) == []  # F16C missing
    assert library.runnable_isas(frozenset({"avx2", "fma", "f16c"})) == ["avx2"]


@pytest.mark.skipif(NATIVE is None, reason="no native library built for this CPU")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("chunk_bytes", [0, 1024, 6144])
def test_probe_reads_every_element_once(threads, chunk_bytes):
    import torch

    buffer = torch.arange(3 * 6144, dtype=torch.float32) % 7  # sum known exactly in fp32
    seconds, checksum = torch.ops.quill.read_probe(buffer, threads, 3, chunk_bytes).tolist()
    assert seconds > 0
    read = (
        buffer
        if not chunk_bytes
        else buffer[: buffer.numel() // (chunk_bytes // 4) * (chunk_bytes // 4)]
    )
    assert checksum == 3 * read.sum().item()
