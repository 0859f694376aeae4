"""vLLM sampler replicas' fixtures: vLLM's own environment (`make vllm-env`: the CPU build here) and a tiny Llama
whose heads vLLM's CPU attention takes (head size 32)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import VLLM_HEADS, make_tiny_model
from whitney.backends.vllm.server import default_python


@pytest.fixture(scope="session")
def vllm_python() -> str:
    python = default_python()
    if not Path(python).is_file():
        pytest.fail(f"no vLLM environment at {python}: `make vllm-env` builds it (`make test` does)")
    return python


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory) -> str:
    """A 2-layer random Llama (hidden 64, two heads of 32, tied embeddings) with the SmolLM2 tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "vllm-tiny", "llama", **VLLM_HEADS))
