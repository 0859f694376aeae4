"""The baseline of a side-by-side benchmark: another commit of Whitney, served from a plain copy of its tree.

`checkout(ref)` extracts `git archive REF` once into build/baseline-<sha12>/ (no worktree, no git state
changed); `start_server(tree, ...)` runs `python -m whitney.cli serve` from that copy with this same
virtualenv, after checking that the copy's `whitney` package is the one the subprocess imports (cwd and
PYTHONPATH are the copy; the editable install of the current tree comes later on sys.path).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

from bench.common import Server, free_port
from whitney.engine import DEFAULT_MODEL

ROOT = Path(__file__).resolve().parent.parent
# main just before issue 15 (throughput under concurrency, paging): the merge-base of that work.
BASELINE_REF = "3f82ad7"


def resolve(ref: str) -> str:
    """The full commit id of `ref` in this repository."""
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"],
                         capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"baseline ref {ref!r} is not a commit of {ROOT}: {out.stderr.strip()}")
    return out.stdout.strip()


def checkout(ref: str = BASELINE_REF) -> tuple[Path, str]:
    """(the extracted tree of `ref` under build/, its full commit id); extracted once, reused after."""
    sha = resolve(ref)
    tree = ROOT / "build" / f"baseline-{sha[:12]}"
    if not (tree / "whitney" / "__init__.py").exists():
        tree.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=tree.parent, prefix=".extract-") as tmp:
            archive = Path(tmp) / "tree.tar"
            with open(archive, "wb") as f:
                subprocess.run(["git", "-C", str(ROOT), "archive", sha], stdout=f, check=True)
            part = Path(tmp) / "tree"
            with tarfile.open(archive) as tar:
                tar.extractall(part, filter="data")
            part.rename(tree)  # atomic: a half-extracted tree is never reused
    return tree, sha


def env_for(tree: Path | None) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    if tree is not None:
        env["PYTHONPATH"] = str(tree) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def imported_from(tree: Path | None) -> str:
    """The `whitney/__init__.py` a server started for `tree` (None: the current tree) imports."""
    cwd = str(tree or ROOT)
    out = subprocess.run([sys.executable, "-c", "import whitney, whitney.cli; print(whitney.__file__)"],
                         cwd=cwd, env=env_for(tree), capture_output=True, text=True, check=True)
    return out.stdout.strip()


def start_server(tree: Path | None, *args: str, model: str = DEFAULT_MODEL, timeout: float = 240.0) -> Server:
    """`whitney serve` from `tree` (None: the current tree) on a free port; returns once it is serving.

    Like bench.common.start_server, with the process's cwd and PYTHONPATH set to the tree; refuses to
    start if the subprocess would import Whitney from anywhere else."""
    where = imported_from(tree)
    expected = (tree or ROOT) / "whitney" / "__init__.py"
    if Path(where).resolve() != expected.resolve():
        raise RuntimeError(f"a server for {tree or ROOT} would import whitney from {where}, not {expected}")
    data_dir = tempfile.TemporaryDirectory(prefix="whitney-bench-")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "whitney.cli", "serve", "--model", model, "--port", str(port),
                             "--data-dir", data_dir.name, *args], cwd=str(tree or ROOT), env=env_for(tree),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            if proc.poll() is not None:
                raise RuntimeError(f"whitney serve ({tree or ROOT}) exited with {proc.returncode}:\n{''.join(lines)}")
            continue
        lines.append(line)
        if "Whitney is serving" in line:
            log_path = os.environ.get("WHITNEY_BENCH_SERVER_LOG")

            def drain() -> None:  # keep the pipe from filling; to the log file when one is named
                with open(log_path or os.devnull, "a") as log:
                    log.writelines(lines)
                    for rest in proc.stdout:
                        log.write(rest)

            threading.Thread(target=drain, daemon=True).start()
            return Server(proc, f"http://127.0.0.1:{port}", data_dir, extra={"whitney_file": where})
    proc.kill()
    proc.wait()
    data_dir.cleanup()
    raise RuntimeError(f"whitney serve ({tree or ROOT}) did not start in {timeout}s:\n{''.join(lines)}")
