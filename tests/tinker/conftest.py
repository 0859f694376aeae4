"""One real Whitney server for the Tinker SDK tests, and the SDK pointed at it by environment, as a user would."""

from __future__ import annotations

import pytest

from tests.service.conftest import start_server
from whitney.service.app import ServiceConfig

API_KEY = "tml-whitney-tests"


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory, tiny_llama):
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path_factory.mktemp("tinker") / "data"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tinker_env(tinker_server):
    """TINKER_BASE_URL and TINKER_API_KEY for the whole session (the SDK reads them when a client is made)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TINKER_BASE_URL", tinker_server.url)
    mp.setenv("TINKER_API_KEY", API_KEY)
    mp.setenv("HF_HUB_OFFLINE", "1")
    yield tinker_server
    mp.undo()


@pytest.fixture(scope="session")
def service_client(tinker_env):
    import tinker

    client = tinker.ServiceClient()
    yield client
    client.close("success").result()
