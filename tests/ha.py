"""Members of a highly available service for the tests: real `whitney serve --ha` processes on one database
(the fixture `ha_members` in tests/conftest.py starts them), and waiting on what they answer."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.service.test_flow import expect, sft_batch

LEASE = 2.0  # seconds: a dead leader is replaced within about this (plus a campaign interval)


class Member:
    """A `whitney serve --ha` process and an HTTP client of it."""

    def __init__(self, model: str, db_url: str, data_dir: Path, log: Path, *flags: str):
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.log = log
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "whitney.cli", "serve", "--model", model, "--port", "0", "--data-dir",
             str(data_dir), "--db-url", db_url, "--ha", "--lease-seconds", str(LEASE), "--threads", "1", *flags],
            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
        deadline = time.monotonic() + 180
        while (found := re.search(r"Whitney is serving .* at (http://127\.0\.0\.1:\d+)", log.read_text())) is None:
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        self.url = found.group(1)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def role(self) -> str | None:
        try:
            return self.http.get("/healthz", timeout=2).json()["role"]
        except httpx.HTTPError:
            return None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.http.close()


def until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return value


def settle(http: httpx.Client, op_id: str) -> dict:
    """An operation's final state, long-polled through `http`."""
    deadline = time.monotonic() + 120
    while (op := expect(http.get(f"/v1/operations/{op_id}", params={"wait": 10}), 200))["status"] in ("queued",
                                                                                                        "running"):
        assert time.monotonic() < deadline, op
    return op


def big_batch() -> list[dict]:
    """Datums of a forward_backward that runs for seconds on the tiny model with one thread (several passes)."""
    return sft_batch([([1] + [(7 * i + j) % 40000 + 3 for j in range(200)], [5, 6, 2]) for i in range(48)])
