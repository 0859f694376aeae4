"""A real `whitney serve` (tiny Llama, API keys on) with a run training through the HTTP API in a background
thread, and Debian's Chromium driven by Playwright. Screenshots go to build/console-screenshots/.

The server and the browser are the package's: every browser test module of tests/console shares them (one
server start, one trainer). The server also serves the tiny Llama under a long directory name (LONG_MODEL),
as a hub id reads, for the runs list's base-model column."""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.console.trainer import Trainer

SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"
KEY_A = "tml-console-test-key-a"
KEY_B = "tml-console-test-key-b"
LONG_MODEL = "HuggingFaceTB-SmolLM2-135M-Instruct-tiny-llama-served-under-a-long-name"
_written: list[Path] = []


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="package")
def console_server(tiny_llama, tmp_path_factory):
    """`whitney serve` in its own process, two API keys, the tiny Llama also as LONG_MODEL; a run of KEY_A trains
    until the package's tests end."""
    from bench.common import start_server

    long_model = tmp_path_factory.mktemp("long-name") / LONG_MODEL  # a copy (hard links): a link's target is named
    shutil.copytree(tiny_llama, long_model, copy_function=os.link)
    server = start_server("--api-key", KEY_A, "--api-key", KEY_B, "--model", str(long_model), model=tiny_llama)
    trainer = Trainer(server.url, KEY_A, steps=100_000, step_delay=0.3, version_every=3, eval_every=3)
    trainer.start()
    assert trainer.ready.wait(120) and trainer.error is None, trainer.error
    server.extra["trainer"] = trainer
    yield server
    trainer.stop()
    server.stop()
    assert trainer.error is None, f"the training thread failed: {trainer.error!r}"


@pytest.fixture(scope="package")
def browser():
    path = chromium_path()
    if path is None:
        pytest.skip("Chromium is not installed (make test installs Debian's chromium): the console's browser "
                    "tests need it")
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install -e '.[test]' brings playwright")
    with playwright.sync_playwright() as p:
        # --no-sandbox: Chromium refuses its sandbox when run as root, as CI runs the suite.
        browser = p.chromium.launch(executable_path=path, headless=True, args=["--no-sandbox"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    """A fresh browser context (no cookies) and page; JavaScript errors on the page fail the test."""
    context = browser.new_context(viewport={"width": 1360, "height": 900}, accept_downloads=True)
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    context.close()
    assert not errors, f"JavaScript errors on the page: {errors}"


def screenshot(page, name: str) -> Path:
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    path = SCREENSHOTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    _written.append(path)
    return path


def pytest_terminal_summary(terminalreporter):
    if _written:
        terminalreporter.write_line(f"console screenshots ({len(_written)}): {SCREENSHOTS}")


def sign_in(page, url: str, key: str) -> None:
    page.goto(f"{url}/console/")
    page.wait_for_url(re.compile(r"/console/login"))
    page.fill("input[name=key]", key)
    page.click("button[type=submit]")


def trainer_of(server):
    return server.extra["trainer"]


def wait_until(condition, timeout: float = 60.0, every: float = 0.25, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out waiting for {what}")
