#!/usr/bin/env bash
# quill on a GPU, in one prepared run: the tests marked `device` on CUDA, and a real-shaped
# model's decode and prefill steps against the card's floors.
#
#   benchmarks/gpu/check.sh [--device cuda|cpu] [--out DIR] [--quick]
#
# On the GPU machine (no network, Python 3.12, its own PyTorch): `--device cuda` (the default)
# installs the carried wheels (.gpu/wheels, fetched here by fetch_wheels.sh), makes the default
# model's stand-in from its carried config and tokenizer (.gpu/smollm2; standin_model.py),
# runs the device tests on cuda, and times a dummy Llama-3.1-8B in bf16
# (bench_device.py). Everything lands in $OUT (or --out): check.log, check.json, tests.xml,
# bench.json. Sized to end within 8 minutes.
#
# The dry run, `--device cpu`, here: fetches the wheels and the model's files into .gpu/ (what a
# GPU run carries), unpacks the wheels into a scratch target for Python 3.12, makes the
# stand-in in a scratch QUILL_CACHE, runs the same tests on cpu and the benchmark at a small
# size. `--quick` (the suite's own check, tests/test_gpu_check.py) runs only the reference
# tests that read the stand-in. Each step's outcome goes to check.json; the exit status is 0 when every
# step passed.
set -uo pipefail

DEVICE=cuda
OUTDIR="${OUT:-}"
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE="$2"; shift 2 ;;
    --out) OUTDIR="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    *) echo "check.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUTDIR="${OUTDIR:-$ROOT/.gpu/out}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
exec > >(tee "$OUTDIR/check.log") 2>&1
STARTED=$(date +%s)
declare -A STATUS=()
step() { echo; echo "== $1 (+$(( $(date +%s) - STARTED )) s)"; }
record() { STATUS[$1]=$2; echo "-- $1: $2"; }

if [ "$DEVICE" = cuda ]; then
  PY=python3
  SCRATCH=/tmp/quill-gpu
else
  PY="${PYTHON:-.venv/bin/python}"
  SCRATCH="$(mktemp -d /tmp/quill-gpu-dry.XXXXXX)"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
REAL_CACHE="${QUILL_CACHE:-$HOME/.cache/quill}"  # the dry run's real model is converted there
export QUILL_CACHE="$SCRATCH/cache" QUILL_NATIVE=0
mkdir -p "$QUILL_CACHE"

step "the machine"
$PY - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| cuda", torch.version.cuda,
      "| device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none")
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv

# What quill needs beyond the GPU image (fetch_wheels.sh has the list): named here, pip takes
# the rest of each one's needs from the same folder only where the image lacks them.
TOP_LEVEL=(fastapi==0.165.0 uvicorn==0.54.0 pydantic==2.14.4 pyzmq==27.3.0 msgspec==0.23.0
           llguidance==1.9.1 gguf==0.19.0 openai==3.57.0 jsonschema==4.26.0)
MODEL_FILES=.gpu/smollm2
step "wheels"
if [ "$DEVICE" = cuda ]; then
  if $PY -m pip install -q --no-index --find-links .gpu/wheels "${TOP_LEVEL[@]}"; then
    record wheels ok
  else  # an environment pip may not write to: beside it, first on the path
    $PY -m pip install -q --no-index --no-deps --target "$SCRATCH/site" .gpu/wheels/*.whl \
      && export PYTHONPATH="$PYTHONPATH:$SCRATCH/site" && record wheels "ok (--target)" \
      || record wheels failed
  fi
else
  mkdir -p "$MODEL_FILES"
  if bash benchmarks/gpu/fetch_wheels.sh .gpu/wheels \
     && $PY -m pip install -q --no-index --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --target "$SCRATCH/site312" .gpu/wheels/*.whl; then
    record wheels "ok (fetched, unpacked for 3.12 in $SCRATCH/site312; not imported here)"
  else
    record wheels failed
  fi
fi

step "the default model's stand-in"
if [ "$DEVICE" = cpu ]; then  # the real model's small files, from the converted model here
  QUILL_CACHE="${REAL_CACHE}" $PY -c "
from quill.model.default_model import default_model_dir as d; import shutil
for f in ('config.json', 'tokenizer.json', 'tokenizer_config.json'):
    shutil.copy(d() / f, '$MODEL_FILES/' + f)"
fi
$PY benchmarks/gpu/standin_model.py "$MODEL_FILES" && record standin ok || record standin failed

step "tests marked device, on $DEVICE"
TESTS=(tests/test_model_reference.py tests/test_loading.py tests/test_attention.py
       tests/test_sampling_safety.py tests/test_token_mask.py tests/server/test_server_cli.py)
if [ "$QUICK" = 1 ]; then  # the suite runs the device tests itself: one shows the script works
  TESTS=(tests/test_model_reference.py::test_logits_close_to_transformers)
fi
timeout 330 $PY -m pytest -q -p no:cacheprovider -m device --device "$DEVICE" \
  --junitxml "$OUTDIR/tests.xml" "${TESTS[@]}" && record tests ok || record tests failed

step "decode and prefill against the floors"
if [ "$DEVICE" = cuda ]; then
  BENCH=(--device cuda --json "$OUTDIR/bench.json")
elif [ "$QUICK" = 1 ]; then  # that the benchmark runs through, at the least size
  BENCH=(--device cpu --shape llama-3.2-1b --layers 1 --batches 1 --context 16 --prompt 64
         --steps 2 --json "$OUTDIR/bench.json")
else
  BENCH=(--device cpu --shape llama-3.2-1b --layers 2 --batches 1,4 --context 64 --prompt 256
         --steps 4 --json "$OUTDIR/bench.json")
fi
timeout 240 $PY benchmarks/gpu/bench_device.py "${BENCH[@]}" && record bench ok \
  || record bench failed

step "summary"
{
  echo "{\"device\": \"$DEVICE\", \"seconds\": $(( $(date +%s) - STARTED )), \"steps\": {"
  first=1
  for key in wheels standin tests bench; do
    [ $first = 1 ] || echo ","
    first=0
    printf '  "%s": "%s"' "$key" "${STATUS[$key]:-not run}"
  done
  echo "}}"
} > "$OUTDIR/check.json"
cat "$OUTDIR/check.json"
for key in wheels standin tests bench; do
  case "${STATUS[$key]:-}" in ok*) ;; *) exit 1 ;; esac
done
