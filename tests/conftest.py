"""Shared fixtures: tiny random Llama and Qwen3 models on disk, loaded through the real code path."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

# Served models are registered in the Hugging Face hub cache under their served names (engine/hub_cache.py):
# the suite's go to a cache of its own, never the user's (set before anything imports huggingface_hub, which
# reads it once; servers the tests start inherit it).
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="whitney-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.models import make_tiny_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite's numbers are the CPU's: engines made with the default device ("auto") would pick a CUDA
# device where one is present, so CUDA is hidden unless WHITNEY_TEST_CUDA=1 (scripts/gpu_check.py sets it
# for the `cuda` tests, which ask for their device by name).
if os.environ.get("WHITNEY_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The tiny models' matmuls are too small to share: a second OpenMP thread only adds barrier waits
# (seconds per test on a busy machine). Tests of the real model ask for more (`torch_threads`).
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _one_torch_thread_after_each_test():
    """An engine started with the CLI's defaults sets this process's threads (`--threads auto`): put back the
    suite's one thread after the test."""
    yield
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


@pytest.fixture
def torch_threads():
    """All cores for the duration of one test (the real 135M model)."""
    before = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> str:
    """Path of a 2-layer Llama (hidden 64, tied embeddings) with the SmolLM2 tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama", "llama"))


@pytest.fixture(scope="session")
def tiny_qwen3(tmp_path_factory) -> str:
    """Path of a 2-layer Qwen3 (hidden 64, q/k norms, untied unembedding) with the SmolLM2 tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-qwen3", "qwen3"))


@pytest.fixture(params=["llama", "qwen3"])
def tiny_model(request, tiny_llama, tiny_qwen3) -> str:
    """Each tiny model in turn."""
    return tiny_llama if request.param == "llama" else tiny_qwen3


@pytest.fixture(scope="session")
def postgres():
    """A throwaway PostgreSQL server for the session (tests/postgres.py); `new_database()` per test."""
    from tests.postgres import PostgresServer, pg_bin

    if pg_bin() is None:
        pytest.skip("PostgreSQL is not installed (make test installs Debian's postgresql)")
    with PostgresServer() as server:
        yield server


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path) -> str:
    """A fresh database: a SQLite file, or a new database on the session's PostgreSQL server."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 's.db'}"
    return request.getfixturevalue("postgres").new_database()


@pytest.fixture
def store(db_url):
    """A Store on each kind of database in turn."""
    from whitney.service.store.database import Store

    return Store(db_url)
