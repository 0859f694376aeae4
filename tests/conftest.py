"""Shared fixtures: tiny random Llama and Qwen3 models on disk, loaded through the real code path."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Served models are registered in the Hugging Face hub cache under their served names (engine/hub_cache.py):
# the suite's go to a cache of its own, never the user's (set before anything imports huggingface_hub, which
# reads it once; servers the tests start inherit it).
os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="whitney-hf-")
atexit.register(shutil.rmtree, os.environ["HF_HUB_CACHE"], True)

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.models import VLLM_HEADS, make_tiny_model  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The suite's numbers are the CPU's: engines made with the default device ("auto") would pick a CUDA
# device where one is present, so CUDA is hidden unless WHITNEY_TEST_CUDA=1 (scripts/gpu_check.py sets it
# for the `cuda` tests, which ask for their device by name).
if os.environ.get("WHITNEY_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The tiny models' matmuls are too small to share: a second OpenMP thread only adds barrier waits
# (seconds per test on a busy machine). Tests of the real model ask for more (`torch_threads`).
torch.set_num_threads(1)


# Two tiers (docs/TESTING.md). `make test` runs everything (CI). `make test-quick` runs `pytest -m "not heavy"`,
# the edit loop's tier: every layer in under 3 minutes. A test is quick unless one of these makes it heavy:
# - it is marked `heavy` (or `slow`: the real model), or is in HEAVY: a directory, a module or one test;
# - it is a second or later case of a parametrized test (the quick tier runs the first case of each sweep);
# - it runs on PostgreSQL (the `postgres` fixture or a "postgresql" parameter): the quick tier's store is SQLite.
HEAVY = {
    "cluster": "a local two-node Ray cluster",
    "console": "the web console in Chromium, driven by Playwright while a run trains",
    "vllm": "vLLM servers (the CPU build, .venv-vllm) as sampler replicas",
    "engine/test_sharded.py": "two gloo ranks in processes of their own",
    "engine/test_data_parallel.py::test_fast_path_mixed_runs_opsd_and_a_custom_graph_equal_unsharded": "two gloo "
    "ranks in processes of their own",
    "engine/test_data_parallel.py::test_general_path_and_moe_equal_unsharded": "two gloo ranks, twice",
    "engine/test_data_parallel.py::test_vision_family_with_image_rows_equals_unsharded": "two gloo ranks",
    "engine/test_rank_local.py": "gloo ranks in processes of their own, and a 134 MB model",
    "engine/test_vision_ray.py": "a local Ray cluster",
    "service/test_fuzz.py": "schemathesis over every route",
    "service/test_ha.py::test_a_killed_leader_is_replaced_and_nothing_acknowledged_is_lost": "two `whitney serve` "
    "processes, one killed",
    "service/test_ha.py::test_the_tinker_sdk_trains_through_a_follower_and_a_stalled_leader_writes_nothing": "two "
    "`whitney serve` processes, one stalled past its lease",
    "test_seed_command.py": "the seed's script end to end",
    "tinker/test_quickstart_doc.py": "the quickstart against `whitney serve` in subprocesses",
    "test_cli.py::test_serve_prints_its_url_and_requires_the_api_key": "`whitney serve` in a subprocess",
    "test_cli.py::test_models_register_makes_a_directorys_name_and_the_embedded_model_load_offline": "the embedded "
    "model",
    "test_model_support.py::test_the_scripts_check_confirms_listed_rows": "a model of each listed row",
    "engine/test_general_path.py::test_models_that_cannot_be_served_are_refused_by_name": "a model of each family",
    "service/test_openai.py::test_the_examples_readme_steps_run_on_the_shipped_data": "the examples end to end",
    "service/test_paging_api.py::test_a_run_in_use_is_not_paged_out": "seconds of a client's pauses",
    "service/test_paging_api.py::test_a_paging_server_gives_the_numbers_of_one_that_never_pages": "two servers "
    "trained side by side (engine/test_paging.py has the same numbers)",
    "service/test_keys.py::test_finished_runs_give_their_memory_back": "20 rank-32 runs, for the RSS",
    "service/test_keys.py::test_the_tinker_sdk_with_a_key_retries_a_429": "the SDK sleeps the Retry-After",
    "service/test_checkpoint_lifecycle.py::test_readers_and_the_reaper_racing_never_both_win": "a race, five "
    "expiries long",
    "test_cli.py::test_sigterm_stops_the_server_while_requests_are_busy": "`whitney serve` in a subprocess, held "
    "busy until it is stopped",
}
TESTS = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)  # before `-m` selects
def pytest_collection_modifyitems(config, items):
    directories = [TESTS / p for p in HEAVY if "::" not in p]
    seen = set()  # the parametrized tests whose first case is collected
    for item in items:
        path, test = Path(item.path), item.nodeid.split("[")[0]
        named = TESTS in path.parents and f"{path.relative_to(TESTS).as_posix()}::{item.originalname}" in HEAVY
        params = item.callspec.params if hasattr(item, "callspec") else {}
        again = bool(params) and test in seen
        seen.add(test)
        on_postgresql = "postgres" in item.fixturenames or any(isinstance(v, str) and v == "postgresql"
                                                               for v in params.values())
        if (item.get_closest_marker("slow") or named or again or on_postgresql
                or any(d == path or d in path.parents for d in directories)):
            item.add_marker(pytest.mark.heavy)


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


# vLLM sampler replicas (tests/vllm, tests/cluster/test_ray_vllm.py): vLLM's own environment (`make vllm-env`, the
# CPU build here), and a tiny Llama whose heads vLLM's CPU attention takes (head size 32).
@pytest.fixture(scope="session")
def vllm_python() -> str:
    from whitney.backends.vllm.server import default_python

    python = default_python()
    if not Path(python).is_file():
        pytest.fail(f"no vLLM environment at {python}: `make vllm-env` builds it (`make test` does)")
    return python


@pytest.fixture(scope="session")
def vllm_tiny(tmp_path_factory) -> str:
    """A 2-layer random Llama (hidden 64, two heads of 32, tied embeddings) with the SmolLM2 tokenizer."""
    return str(make_tiny_model(tmp_path_factory.mktemp("models") / "vllm-tiny", "llama", **VLLM_HEADS))


@pytest.fixture
def ha_members(postgres, tiny_llama, tmp_path):
    """Start `whitney serve --ha` processes on one new database and one data directory (the first one to ask leads)."""
    from tests.ha import Member, until

    db_url, started = postgres.new_database(), []

    def start(n: int, *flags: str) -> list[Member]:
        for _ in range(n):
            started.append(Member(tiny_llama, db_url, tmp_path / "data", tmp_path / f"member{len(started)}.log",
                                  *flags))
        until(lambda: sum(m.role() == "leader" for m in started) == 1, 30, "one leader")
        return started

    start.db_url = db_url
    yield start
    for m in started:
        m.stop()
