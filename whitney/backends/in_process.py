"""The "inprocess" backend: the engine in this process (engine/backend.py InProcessBackend)."""

from __future__ import annotations

from whitney.engine.backend import InProcessBackend
from whitney.errors import InvalidInput
from whitney.protocol.backend import BackendSpec


def start_backend(spec: BackendSpec) -> InProcessBackend:
    """The in-process backend (whitney/backends: "inprocess") with the spec's models loaded, each also under the
    name it is served by. The Ray settings are refused here, never ignored."""
    if spec.ray_address or spec.samplers or spec.worker_resources:
        raise InvalidInput("ray_address, samplers and worker_resources need the ray backend", field="backend")
    backend = InProcessBackend.start(spec.engine, [])
    for name, served in spec.models:
        backend.load_model(name, alias=served)
    return backend
