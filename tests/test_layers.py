"""The layers import only downward, and the import graph has no circles.

    service (HTTP APIs, store, scheduler)  ->  protocol (plain data, the Backend)  <-  backends  ->  engine

The service sees a backend only through whitney/protocol and picks one by name (whitney/backends); only a backend's
plug-in module imports the engine; the engine never imports HTTP, the database, the service or the backends.
"""

from __future__ import annotations

import ast
import warnings
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "whitney"
FORBIDDEN_IN_ENGINE = ("fastapi", "starlette", "sqlalchemy", "uvicorn", "pydantic", "whitney.service",
                       "whitney.backends", "whitney.client", "httpx", "requests")
REDESIGN_LINES = 500  # a module past this is a signal to split it by responsibility


def imported_modules(path: Path) -> set[str]:
    """Every absolute module `path` imports, at its top or inside a function (a lazy import is still an edge)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names |= {f"{node.module}.{alias.name}" for alias in node.names}  # a submodule, or a name of the module
    return names


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """{module: the whitney modules it imports}; `from package import name` counts as importing the module
    `package.name` when that is one, else the package (each import resolved to the longest module it names)."""
    paths = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        edges = set()
        for imported in imported_modules(path):
            while imported and imported not in paths:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                edges.add(imported)
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for edge in edges:
                if edge not in index:
                    index[edge] = low[edge] = len(index)
                    stack.append(edge)
                    on_stack.add(edge)
                    work.append((edge, iter(sorted(graph[edge]))))
                    break
                if edge in on_stack:
                    low[node] = min(low[node], index[edge])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_import_graph_has_no_circles():
    """Counting imports inside functions: a lazy import that dodges a circle is still a circle."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # the check itself
    graph = import_graph()
    assert "whitney.service.app" in graph and "whitney.engine.training.runs" in graph
    found = cycles(graph)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) for c in found)


def test_the_layers_import_downward_only():
    """protocol imports nothing of whitney but errors; service imports no backend plug-in and no engine; the
    registry (whitney/backends/__init__.py) imports no plug-in; the engine imports no service and no backend."""
    rules = {"whitney.protocol": ("whitney.engine", "whitney.service", "whitney.backends", "whitney.cli"),
             "whitney.service": ("whitney.engine", "whitney.backends.in_process", "whitney.backends.ray",
                                 "whitney.cli"),
             "whitney.engine": ("whitney.service", "whitney.backends", "whitney.cli")}
    for module, edges in import_graph().items():
        for layer, forbidden in rules.items():
            if module == layer or module.startswith(layer + "."):
                bad = sorted(e for e in edges if any(e == f or e.startswith(f + ".") for f in forbidden))
                assert not bad, f"{module} imports {bad}: {layer} must not"
    registry = import_graph()["whitney.backends"]
    assert all(not e.startswith(("whitney.engine", "whitney.backends.")) for e in registry), registry


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


def test_service_never_imports_torch():
    # (The client may: forward_backward_custom runs the user's torch loss on the client.)
    files = sorted((PACKAGE / "service").rglob("*.py"))
    assert files, "service package not found"
    for path in files:
        for name in imported_modules(path):
            assert not (name == "torch" or name.startswith("torch.") or name.startswith("transformers")), \
                f"{path.relative_to(PACKAGE.parent)} imports {name}: the service hands plain data to the engine"


def test_big_modules_are_flagged_for_a_redesign():
    """Not a cap that forces lines elsewhere: a module past REDESIGN_LINES is reported (a pytest warning, in
    every run's summary) as the signal to split it by responsibility."""
    big = {str(p.relative_to(PACKAGE.parent)): n for p in sorted(PACKAGE.rglob("*.py"))
           if (n := len(p.read_text().splitlines())) > REDESIGN_LINES}
    for path, lines in big.items():
        warnings.warn(f"{path} has {lines} lines (> {REDESIGN_LINES}): time to split it by responsibility")


def test_the_in_process_backend_refuses_the_ray_settings_rather_than_ignore_them():
    import pytest

    from whitney import backends
    from whitney.errors import InvalidInput
    from whitney.protocol.backend import BackendSpec, SamplerReplicas
    from whitney.protocol.config import EngineConfig

    for settings in ({"samplers": SamplerReplicas(1, 1)}, {"ray_address": "auto"}, {"worker_resources": {"m": {"cpus": 2.0}}}):
        with pytest.raises(InvalidInput) as e:
            backends.start("inprocess", BackendSpec(EngineConfig(), (), **settings))
        assert e.value.field == "backend" and "need the ray backend" in e.value.message
    with pytest.raises(InvalidInput) as e:
        backends.start("gpu-magic", BackendSpec(EngineConfig(), ()))
    assert e.value.field == "backend" and "inprocess" in e.value.message
