"""A real Whitney server on a free port (uvicorn in a thread), over a real SQLite file in tmp_path."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import uvicorn

from whitney.service.app import ServiceConfig, create_app, serve_in_thread


@dataclass
class RunningServer:
    url: str
    config: ServiceConfig
    server: uvicorn.Server
    thread: threading.Thread
    app: object

    def http(self, api_key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    @property
    def engine(self):
        """The in-process engine behind the server's backend (for exactness checks)."""
        return self.app.state.whitney.scheduler.backend.engine

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start_server(config: ServiceConfig) -> RunningServer:
    app = create_app(config)
    running = serve_in_thread(app)
    return RunningServer(running.url, config, running.server, running.thread, app)


@pytest.fixture
def make_server(tmp_path: Path, tiny_llama: str):
    """Start servers on the tiny Llama (more models via models=[...]); all are stopped at the end."""
    started: list[RunningServer] = []

    def make(**overrides) -> RunningServer:
        config = ServiceConfig(models=[tiny_llama], data_dir=tmp_path / "data")
        for key, value in overrides.items():
            setattr(config, key, value)
        server = start_server(config)
        started.append(server)
        return server

    yield make
    for server in started:
        server.stop()


@pytest.fixture
def server(make_server) -> RunningServer:
    """One server on the tiny Llama, no API keys."""
    return make_server()
