"""A real `whitney serve` (tiny Llama, API keys on) with a run training through the HTTP API in a background
thread, and Debian's Chromium driven by Playwright. Screenshots go to build/console-screenshots/."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.console.trainer import Trainer

SCREENSHOTS = Path(__file__).resolve().parents[2] / "build" / "console-screenshots"
KEY_A = "tml-console-test-key-a"
KEY_B = "tml-console-test-key-b"
_written: list[Path] = []


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser"):
        found = shutil.which(name)
        if found:
            return found
    return None


@pytest.fixture(scope="module")
def console_server(tiny_llama):
    """`whitney serve` in its own process, two API keys; a run of KEY_A trains until the module ends."""
    from bench.common import start_server

    server = start_server("--api-key", KEY_A, "--api-key", KEY_B, model=tiny_llama)
    trainer = Trainer(server.url, KEY_A, steps=100_000, step_delay=0.3, version_every=3, eval_every=3)
    trainer.start()
    assert trainer.ready.wait(120) and trainer.error is None, trainer.error
    server.extra["trainer"] = trainer
    yield server
    trainer.stop()
    server.stop()
    assert trainer.error is None, f"the training thread failed: {trainer.error!r}"


@pytest.fixture(scope="module")
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
