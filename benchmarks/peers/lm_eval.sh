#!/usr/bin/env bash
# Installs EleutherAI's lm-evaluation-harness (`lm_eval`), the tool people evaluate models with,
# as a benchmark peer for quill: benchmarks/bench_lm_eval.py runs one task of ours through it
# twice, against `quill serve` (its local-completions model: echo, logprobs, prompt scoring)
# and on transformers directly (its hf model), and compares the two. A benchmark dependency
# only: quill itself never needs any of it.
#
# lm-eval's hf model needs torch and transformers, so it gets a virtual environment of its own,
# not quill's .venv. torch is installed first, pinned to a CPU build (the PyTorch CPU index, or
# plain PyPI when that is unreachable), so that pip does not pull the CUDA wheels.
#
# Idempotent: a no-op once the pinned version is installed. Prints the lm_eval executable.
#
# Usage: bash benchmarks/peers/lm_eval.sh
# Environment: QUILL_CACHE, LM_EVAL_VERSION (default 0.4.13), PYTHON (default python3.11).
set -euo pipefail

PEERS=${QUILL_CACHE:-$HOME/.cache/quill}/peers
VENV="$PEERS/lm-eval-venv"
VERSION=${LM_EVAL_VERSION:-0.4.13}
PYTHON=${PYTHON:-python3.11}
TORCH_PIN="torch==2.13.0"

log() { printf '[lm_eval.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$PEERS"

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$VENV/.torch-installed" ]]; then
    echo "$TORCH_PIN" >"$VENV/torch-constraint.txt"
    if ! "$VENV/bin/pip" install -q --timeout 20 --retries 1 \
        --index-url https://download.pytorch.org/whl/cpu "$TORCH_PIN"; then
        log "CPU index unreachable, installing $TORCH_PIN from the default index"
        "$VENV/bin/pip" install -q "$TORCH_PIN"
    fi
    touch "$VENV/.torch-installed"
fi
if [[ ! -f "$VENV/.installed-$VERSION" ]]; then
    log "installing lm-eval[api,hf]==$VERSION"
    "$VENV/bin/pip" install -q -c "$VENV/torch-constraint.txt" "lm-eval[api,hf]==$VERSION"
    "$VENV/bin/python" - <<'PY'
import importlib.metadata as md

import torch

print(f"lm-eval {md.version('lm-eval')}, torch {torch.__version__}, "
      f"transformers {md.version('transformers')}")
PY
    rm -f "$VENV"/.installed-*
    touch "$VENV/.installed-$VERSION"
fi
"$VENV/bin/lm_eval" --help >/dev/null
echo "$VENV/bin/lm_eval"
