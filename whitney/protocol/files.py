"""Checkpoint directories appear whole or not at all: written beside their place and renamed in (`atomic_dir`), and
what a killed process left half-written removed at the next start (`remove_leftovers`). Torch-free: the engine
writes packages this way and the service cleans up after a crash.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from whitney.errors import Conflict


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def temp_beside(path: str | Path) -> Path:
    """A new temporary directory beside `path` (`.{name}.tmp-*`, which `remove_leftovers` recognises); Conflict
    if `path` exists already."""
    target = Path(path)
    if target.exists():
        raise Conflict(f"{target} already exists", field="path")
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))


def publish(tmp: Path, path: str | Path) -> None:
    """fsync every file of `tmp` and `tmp` itself, rename it to `path`, fsync the parent: whole or not at all."""
    target = Path(path)
    for f in tmp.rglob("*"):
        if f.is_file():
            _fsync(f)
    _fsync(tmp)
    os.rename(tmp, target)
    _fsync(target.parent)


@contextmanager
def atomic_dir(path: str | Path):
    """Yield a temporary directory beside `path`; on success publish it as `path`, on failure remove it."""
    tmp = temp_beside(path)
    try:
        yield tmp
        publish(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_leftovers(directory: str | Path) -> list[Path]:
    """Delete the temporary directories (`.{name}.tmp-*`) that `atomic_dir` left in `directory` when the
    process died mid-write; return them. Call it at startup, before anything writes there: a finished
    checkpoint never has that name, so only half-written ones are removed."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    leftovers = [p for p in directory.glob(".*.tmp-*") if p.is_dir() and not p.is_symlink()]
    for p in leftovers:
        shutil.rmtree(p, ignore_errors=True)
    return leftovers
