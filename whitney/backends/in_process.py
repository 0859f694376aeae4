"""The "inprocess" backend: the engine in this process (engine/backend.py InProcessBackend)."""

from __future__ import annotations

from whitney.engine.backend import InProcessBackend
from whitney.protocol.backend import BackendSpec


def start_backend(spec: BackendSpec) -> InProcessBackend:
    """The in-process backend (whitney/backends: "inprocess") with the spec's models loaded, each also under the
    name it is served by."""
    backend = InProcessBackend.start(spec.engine, [])
    for name, served in spec.models:
        backend.load_model(name, alias=served)
    return backend
