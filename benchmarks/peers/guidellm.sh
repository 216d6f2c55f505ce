#!/usr/bin/env bash
# Installs guidellm, a widely used LLM serving benchmark client, as a benchmark peer for quill:
# benchmarks/bench_guidellm.py runs it against `quill serve` to check that a real third-party
# client's requests (vLLM's stream_options.continuous_usage_stats, ignore_eos, ...) are served,
# and to report its numbers. A benchmark dependency only: quill itself never needs any of it.
#
# guidellm depends on torch and transformers, so it gets a virtual environment of its own, not
# quill's .venv. torch is installed first, pinned to a CPU build (the PyTorch CPU index, or a
# local +cpu wheel pip's find-links know of), so that pip does not pull the CUDA wheels.
#
# Idempotent: a no-op once the pinned version is installed. Prints the guidellm executable.
#
# Usage: bash benchmarks/peers/guidellm.sh
# Environment: QUILL_CACHE, GUIDELLM_VERSION (default 0.8.1), PYTHON (default python3.11).
set -euo pipefail

PEERS=${QUILL_CACHE:-$HOME/.cache/quill}/peers
VENV="$PEERS/guidellm-venv"
VERSION=${GUIDELLM_VERSION:-0.8.1}
PYTHON=${PYTHON:-python3.11}
TORCH_PIN="torch==2.13.0"

log() { printf '[guidellm.sh %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
mkdir -p "$PEERS"

if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
if [[ ! -f "$VENV/.torch-installed" ]]; then
    echo "$TORCH_PIN" >"$VENV/torch-constraint.txt"
    # The CPU index first; plain PyPI (with any local +cpu wheel pip knows of) if unreachable.
    if ! "$VENV/bin/pip" install -q --timeout 20 --retries 1 \
        --index-url https://download.pytorch.org/whl/cpu "$TORCH_PIN"; then
        log "CPU index unreachable, installing $TORCH_PIN from the default index"
        "$VENV/bin/pip" install -q "$TORCH_PIN"
    fi
    touch "$VENV/.torch-installed"
fi
if [[ ! -f "$VENV/.installed-$VERSION" ]]; then
    log "installing guidellm==$VERSION"
    "$VENV/bin/pip" install -q -c "$VENV/torch-constraint.txt" "guidellm==$VERSION"
    "$VENV/bin/python" - <<'EOF'
import importlib.metadata as md

import torch

print(f"guidellm {md.version('guidellm')}, torch {torch.__version__}, "
      f"cuda {torch.version.cuda}, transformers {md.version('transformers')}")
EOF
    rm -f "$VENV"/.installed-*
    touch "$VENV/.installed-$VERSION"
fi
"$VENV/bin/guidellm" --help >/dev/null
echo "$VENV/bin/guidellm"
