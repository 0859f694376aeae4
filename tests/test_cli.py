"""`whitney serve` as a user starts it: a subprocess that prints its URL, then serves with API keys, logs its
requests and operations, and says when it stops; its help, its port check and its compute threads."""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx


def test_serve_prints_its_url_and_requires_the_api_key(tiny_llama, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "whitney.cli", "serve", "--model", tiny_llama, "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--api-key", "secret", "--dtype", "bfloat16",
                             "--threads", "1"],
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
        assert "(cpu, bfloat16, 1 compute thread)" in "".join(seen), "--threads reaches the engine process"
        assert caps.json()["models"][0]["compute_threads"] == 1
        run = httpx.post(f"{url}/v1/sessions/{created.json()['id']}/runs", json={"lora": {"rank": 2}},
                         headers={"Authorization": "Bearer secret"})
        assert run.status_code == 201, run.text
        op = httpx.post(f"{url}/v1/runs/{run.json()['id']}/optim_step", json={"seq_id": 0},
                        headers={"Authorization": "Bearer secret"}).json()
        deadline = time.time() + 60
        while httpx.get(f"{url}/v1/operations/{op['id']}", headers={"Authorization": "Bearer secret"}
                        ).json()["status"] in ("queued", "running") and time.time() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    # It logs each request and each operation that ended, and says that it stops.
    assert re.search(r'INFO uvicorn.access: .* "POST /v1/sessions HTTP/1.1" 201', out), out
    assert re.search(rf"INFO whitney.service.scheduling.ends: optim_step {op['id']} of run {run.json()['id']} "
                     r"\(seq_id 0\) succeeded, [\d.]+ s after it was submitted", out), out
    assert "Whitney is stopping (SIGTERM)" in out and out.rstrip().endswith("Whitney stopped."), out


# `whitney serve` with its text check held on the request thread for a marked body (as a request thread stays busy
# in a slow route): an instrumented check, the rest of the server as it runs.
HELD_SERVE = """
import sys, threading
from whitney.service.http import text
real = text.body_error
def held(body, content_type):
    if body.startswith(b'{"hold"'):
        print("a request thread is held", flush=True)
        threading.Event().wait(3600)
    return real(body, content_type)
text.body_error = held
from whitney.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_sigterm_stops_the_server_while_requests_are_busy(tiny_llama, tmp_path):
    """SIGTERM while a request thread is busy (held for an hour) and a long-poll waits on an operation that
    cannot run: the server stops within seconds (it waited for both: the busy thread forever, the long-poll
    for its 30 s). The bound below is a liveness bound, not a timing: the server is held far longer without the
    fix."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen([sys.executable, "-c", HELD_SERVE, "serve", "--model", tiny_llama, "--port", "0",
                             "--data-dir", str(tmp_path / "data"), "--threads", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: list[str] = []

    def line_with(pattern: str) -> re.Match:
        while True:
            line = proc.stdout.readline()
            assert line, f"server exited early: {''.join(seen)}"
            seen.append(line)
            if match := re.search(pattern, line):
                return match

    def quietly(request) -> None:  # the server stops under these requests: their errors are expected
        try:
            request()
        except httpx.HTTPError:
            pass

    try:
        url = line_with(r"serving .* at (http://127\.0\.0\.1:\d+)").group(1)
        session = httpx.post(f"{url}/v1/sessions", json={}).json()["id"]
        run = httpx.post(f"{url}/v1/sessions/{session}/runs", json={"lora": {"rank": 2}}).json()["id"]
        op = httpx.post(f"{url}/v1/runs/{run}/optim_step", json={"seq_id": 3}).json()["id"]  # waits for 0-2
        long_poll = threading.Thread(target=quietly, daemon=True, args=(
            lambda: httpx.get(f"{url}/v1/operations/{op}?wait=30", timeout=60),))
        held = threading.Thread(target=quietly, daemon=True, args=(
            lambda: httpx.post(f"{url}/v1/sessions", content=b'{"hold": "' + b"x" * (256 << 10) + b'"}',
                               headers={"content-type": "application/json"}, timeout=60),))
        long_poll.start()
        held.start()
        line_with("a request thread is held")
        assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            out = proc.communicate()[0]
            raise AssertionError(f"still running 20 s after SIGTERM: {''.join(seen) + out}") from None
    out = "".join(seen) + out
    assert proc.returncode == 0, out
    assert "Whitney is stopping (SIGTERM)" in out and "Whitney stopped" in out, out


def test_the_help_loads_no_torch_and_every_option_says_what_it_does():
    probe = ("import sys\nfrom whitney.cli import main\n"
             "for argv in (['--help'], ['serve', '--help'], ['demo', '--help'], ['keys', 'create', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "print('LOADED', sorted(m for m in ('torch', 'transformers', 'sqlalchemy', 'fastapi', 'whitney.engine')"
             " if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "LOADED []" in done.stdout, "printing help must not load torch, the engine or the store"

    from whitney.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices
    for command in ("serve", "demo"):
        for action in commands[command]._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"whitney {command} {action.option_strings[0]} has no help"
    serve_help = " ".join(commands["serve"].format_help().split())  # unwrapped
    for shown in ("(default: 127.0.0.1)", "(default: 8000)", "(default: 600.0)", "(default: 128)",
                  "--threads N", "(default: info)"):
        assert shown in serve_help, shown
    assert "(default: 12)" in commands["demo"].format_help()


def test_a_port_in_use_is_said_in_one_line_before_any_model_loads(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "whitney.cli", "serve", "--model", str(tmp_path / "no-model"),
                               "--port", str(port), "--data-dir", str(tmp_path / "d")],
                              capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == (f"whitney serve: cannot listen on 127.0.0.1:{port}: the port is in use "
                                   "(another server?); stop it or choose another --port"), done.stderr
    assert not (tmp_path / "d").exists(), "nothing was set up before the port was checked"
    bad = subprocess.run([sys.executable, "-m", "whitney.cli", "serve", "--port", "70000"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "--port: must be a port number from 0 to 65535, got '70000'" in bad.stderr


def test_models_register_makes_a_directorys_name_and_the_embedded_model_load_offline(tiny_llama, tmp_path):
    from transformers import AutoConfig

    from whitney.protocol.config import DEFAULT_MODEL

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(tmp_path / "hub")}
    for model, name in ((tiny_llama, "tiny-llama"), (None, DEFAULT_MODEL)):
        done = subprocess.run([sys.executable, "-m", "whitney.cli", "models", "register", *([model] if model else [])],
                              capture_output=True, text=True, env=env, timeout=300)
        assert done.returncode == 0 and f"{name!r} now loads offline" in done.stdout, done.stdout + done.stderr
        assert AutoConfig.from_pretrained(name, cache_dir=tmp_path / "hub", local_files_only=True).vocab_size == 49152
    missing = subprocess.run([sys.executable, "-m", "whitney.cli", "models", "register", str(tmp_path / "nothing")],
                             capture_output=True, text=True, env=env, timeout=60)
    assert missing.returncode == 2 and "neither the embedded" in missing.stderr, missing.stderr
