"""`whitney serve` as a user starts it: a subprocess that prints its URL, then serves with API keys."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import httpx


def test_serve_prints_its_url_and_requires_the_api_key(tiny_llama, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "whitney.cli", "serve", "--model", tiny_llama, "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--api-key", "secret", "--dtype", "bfloat16"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url, deadline, seen = None, time.time() + 120, []
        while url is None and time.time() < deadline:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, f"server exited early: {''.join(seen)}"
            seen.append(line)
            match = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", line)
            url = match.group(1) if match else None
        assert url is not None, f"no URL printed: {''.join(seen)}"
        assert httpx.get(f"{url}/v1/training/capabilities").status_code == 401  # keys cover every route
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}  # but the health check
        caps = httpx.get(f"{url}/v1/training/capabilities", headers={"Authorization": "Bearer secret"})
        assert caps.status_code == 200 and caps.json()["models"][0]["compute_dtype"] == "bfloat16"
        assert httpx.post(f"{url}/v1/sessions", json={}).status_code == 401
        created = httpx.post(f"{url}/v1/sessions", json={}, headers={"Authorization": "Bearer secret"})
        assert created.status_code == 201 and created.json()["status"] == "active"
        assert (tmp_path / "data" / "whitney.db").exists(), "the default database is a SQLite file in the data dir"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
