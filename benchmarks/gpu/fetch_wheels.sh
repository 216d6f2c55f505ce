#!/usr/bin/env bash
# Fetch the wheels quill needs on the GPU machine beyond what its image already has.
#
# The GPU machine has no network, so these wheels travel with the repo copy (in .gpu/wheels,
# which .gitignore ignores; benchmarks/gpu/check.sh fetches them there and installs them). They are for its Python 3.12 (CPython, manylinux x86_64), pinned to
# requirements.txt's versions. Install them there by NAME so pip upgrades only what is missing or
# too old and leaves the image's own packages alone, e.g.:
#   python3 -m pip install --no-index --find-links .gpu/wheels fastapi==0.165.0 uvicorn==0.54.0 \
#     pydantic==2.14.4 pyzmq==27.3.0 msgspec==0.23.0 llguidance==1.9.1 gguf==0.19.0 \
#     openai==3.57.0 jsonschema==4.26.0
#   python3 -m pip install --no-deps --no-build-isolation -e .   (or run with PYTHONPATH=.)
#
# Image packages relied on (not fetched here): torch 2.11, transformers 5.17, tokenizers 0.23.2,
# safetensors 0.8, huggingface-hub 1.33, numpy 2.5, httpx, httpcore, prometheus-client, psutil,
# pytest, hypothesis, jinja2, tqdm, pyyaml, requests, regex, click, attrs, annotated-doc,
# matplotlib, packaging.
# typing_extensions, anyio, idna and h11 are in the image too; they are fetched only as insurance
# for floors the image's versions may not meet (pydantic-core needs typing-extensions>=4.16,
# openai/httpx2 need anyio>=4.10 and idna>=3.18, httpcore2 needs h11>=0.16); installing by name
# as above uses them only when needed.
#
# Usage: benchmarks/gpu/fetch_wheels.sh [DEST]   (DEST defaults to .gpu/wheels at the repo root)
#        PYTHON=/path/to/python to use another interpreter's pip (default .venv/bin/python).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
DEST="${1:-$ROOT/.gpu/wheels}"
mkdir -p "$DEST"
DEST="$(cd "$DEST" && pwd)"
cd "$ROOT"
PY="${PYTHON:-.venv/bin/python}"

PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
           --platform manylinux1_x86_64)

# name==version, and any extra platform tag the wheel needs.
WHEELS=(
  "fastapi==0.165.0"
  "starlette==1.10.0"
  "opentelemetry_api==1.45.2"
  "pydantic==2.14.4"
  "pydantic_core==2.50.5"
  "annotated_types==0.8.0"
  "typing_inspection==0.4.5"
  "uvicorn==0.54.0"
  "pyzmq==27.3.0"
  "msgspec==0.23.0"
  "llguidance==1.9.1 manylinux_2_31_x86_64"
  "gguf==0.19.0"
  "openai==3.57.0"
  "httpx2==2.16.2"
  "httpcore2==2.16.2"
  "truststore==0.10.5"
  "jiter==0.19.0"
  "sniffio==1.3.1"
  "jsonschema==4.26.0"
  "jsonschema_specifications==2025.9.1"
  "referencing==0.37.0"
  "rpds_py==2026.9.1"
  "typing_extensions==4.16.0"
  "anyio==4.16.0"
  "idna==3.20"
  "h11==0.16.0"
)

# One pip for every missing wheel: a pip per wheel spent ~0.5 s each starting up.
have() {  # the path of name-version's wheel in DEST, or nothing
  shopt -s nullglob
  local found=("$DEST/$1-$2-"*.whl)
  shopt -u nullglob
  [ "${#found[@]}" -gt 0 ] && echo "${found[0]}"
}
missing=()
flags=("${PLATFORMS[@]}")
for entry in "${WHEELS[@]}"; do
  read -r spec extra <<<"$entry"
  if [ -n "$(have "${spec%%==*}" "${spec##*==}")" ]; then
    echo "have ${spec}"
  else
    missing+=("$spec")
    if [ -n "${extra:-}" ]; then flags+=(--platform "$extra"); fi
  fi
done
if [ "${#missing[@]}" -gt 0 ]; then
  "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp "${flags[@]}" -d "$DEST" "${missing[@]}"
fi

total=0
for entry in "${WHEELS[@]}"; do
  read -r spec _ <<<"$entry"
  wheel="$(have "${spec%%==*}" "${spec##*==}")"
  if [ -z "$wheel" ]; then
    echo "fetch_wheels: no wheel file for $spec in $DEST after download" >&2
    exit 1
  fi
  total=$((total + $(stat -c %s "$wheel")))
done

limit=$((48 * 1024 * 1024))
echo "fetch_wheels: ${#WHEELS[@]} wheels in $DEST, $total bytes ($((total / 1024 / 1024)) MiB)"
if [ "$total" -gt "$limit" ]; then
  echo "fetch_wheels: total $total bytes exceeds 48 MiB" >&2
  exit 1
fi
