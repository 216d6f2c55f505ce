"""`quill generate` and `quill chat` as a user runs them."""

from __future__ import annotations

import subprocess
import sys

from quill import SamplingParams

# The exact path, as tests/conftest.py's `llm` runs it: `auto` would choose by what measures
# fastest on this CPU (int8 weights, a 16-bit cache on some), and the texts would differ.
ENGINE_FLAGS = [
    "--dtype", "float32", "--kv-cache-dtype", "float32", "--quantization", "none",
    "--kv-cache-memory", "64MiB",
]  # fmt: skip


def run_cli(args: list[str], stdin: str = "") -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "quill.cli", *args, *ENGINE_FLAGS],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return proc.stdout


def test_generate_streams_the_engines_text(llm):
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs[0].text
    out = run_cli(
        ["generate", "The capital of France is", "--max-tokens", "8", "--temperature", "0"]
    )
    assert out == expected + "\n"


def test_chat_uses_the_chat_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    expected = llm.chat(messages, SamplingParams(max_tokens=12, temperature=0), use_tqdm=False)
    out = run_cli(
        ["chat", "--max-tokens", "12", "--temperature", "0"],
        stdin="What is the capital of France?\n\n",
    )
    assert expected[0].outputs[0].text in out
