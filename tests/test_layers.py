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
