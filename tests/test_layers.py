"""The layers import only downward: the engine never imports HTTP or database code."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "whitney"
FORBIDDEN_IN_ENGINE = ("fastapi", "starlette", "sqlalchemy", "uvicorn", "pydantic", "whitney.service",
                       "whitney.client", "httpx", "requests")


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_engine_imports_no_http_or_database():
    files = sorted((PACKAGE / "engine").rglob("*.py"))
    assert files, "engine package not found"
    for path in files:
        for name in imported_modules(path):
            assert not any(name == f or name.startswith(f + ".") for f in FORBIDDEN_IN_ENGINE), \
                f"{path.relative_to(PACKAGE.parent)} imports {name}: the engine must not know HTTP or the database"


def test_the_control_plane_loads_no_torch_and_no_engine():
    """In a fresh interpreter, the whole service (app, routes, store, scheduler, console, Tinker routes) and the
    backend registry import without torch or any engine module: the engine loads only when a backend starts."""
    import subprocess
    import sys

    probe = ("import sys, whitney.service.app, whitney.backends, whitney.cli\n"
             "print(sorted(m for m in sys.modules if m in ('torch', 'transformers', 'ray') "
             "or m.startswith('whitney.engine')))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"importing the control plane loaded {done.stdout.strip()}"


def test_service_and_protocol_never_import_the_engine():
    """Only a backend's plug-in module (whitney/backends/NAME.py) imports the engine; the registry does not."""
    for path in [*sorted((PACKAGE / "service").rglob("*.py")), *sorted((PACKAGE / "protocol").rglob("*.py")),
                 PACKAGE / "backends" / "__init__.py"]:
        for name in imported_modules(path):
            assert not (name == "whitney.engine" or name.startswith("whitney.engine.")), \
                f"{path.relative_to(PACKAGE.parent)} imports {name}: only a backend's plug-in module may"


def test_service_never_imports_torch():
    # (The client may: forward_backward_custom runs the user's torch loss on the client.)
    files = sorted((PACKAGE / "service").rglob("*.py"))
    assert files, "service package not found"
    for path in files:
        for name in imported_modules(path):
            assert not (name == "torch" or name.startswith("torch.") or name.startswith("transformers")), \
                f"{path.relative_to(PACKAGE.parent)} imports {name}: the service hands plain data to the engine"


def test_engine_modules_stay_small():
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = len(path.read_text().splitlines())
        assert lines <= 500, f"{path.name} has {lines} lines; split it by job"


def test_the_in_process_backend_refuses_the_ray_settings_rather_than_ignore_them():
    import pytest

    from whitney import backends
    from whitney.errors import InvalidInput
    from whitney.protocol.backend import BackendSpec
    from whitney.protocol.config import EngineConfig

    for settings in ({"samplers": 1}, {"ray_address": "auto"}, {"worker_resources": {"m": {"cpus": 2.0}}}):
        with pytest.raises(InvalidInput) as e:
            backends.start("inprocess", BackendSpec(EngineConfig(), (), **settings))
        assert e.value.field == "backend" and "need the ray backend" in e.value.message
    with pytest.raises(InvalidInput) as e:
        backends.start("gpu-magic", BackendSpec(EngineConfig(), ()))
    assert e.value.field == "backend" and "inprocess" in e.value.message
