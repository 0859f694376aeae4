"""`whitney serve` prints where its web console is, beside the line that says it is serving."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx


def test_serve_prints_the_console_url(tiny_llama, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "whitney.cli", "serve", "--model", tiny_llama, "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--api-key", "tml-serve-console"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        console, serving, seen, deadline = None, None, [], time.time() + 120
        while console is None and time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"server exited early: {''.join(seen)}"
            seen.append(line)
            serving = serving or re.search(r"Whitney is serving .* at (http://127\.0\.0\.1:\d+)", line)
            console = re.search(r"web console is at (http://127\.0\.0\.1:\d+/console/) \(sign in with an API key\)",
                                line)
        assert serving and console, f"no serving and console lines: {''.join(seen)}"
        assert console.group(1) == serving.group(1) + "/console/"
        page = httpx.get(console.group(1), headers={"Accept": "text/html"})
        assert page.status_code == 303 and "/console/login" in page.headers["location"]
        assert httpx.get(page.headers["location"] if page.headers["location"].startswith("http")
                         else serving.group(1) + page.headers["location"]).status_code == 200
    finally:
        proc.terminate()
        proc.wait(timeout=30)
