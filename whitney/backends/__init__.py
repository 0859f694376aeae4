"""The backends `whitney serve --backend NAME` picks from, by name. Each is a module of this package with a
`start_backend(spec: BackendSpec) -> ServedBackend`, imported only when chosen: the control plane imports this
registry without loading torch, the engine or Ray. A new backend is one module and one line here. vLLM sampler
replicas (whitney/backends/vllm) go beside whichever backend is chosen.
"""

from __future__ import annotations

import importlib

from whitney.errors import InvalidInput
from whitney.protocol.backend import BackendSpec, SamplerEngine, ServedBackend

BACKENDS = {
    "inprocess": "whitney.backends.in_process",  # the engine in this process
    "ray": "whitney.backends.ray",  # a trainer (and sampler replicas) per model in Ray actors
}
# Sampler replicas of another engine, beside whichever backend (`--sampler-engine`); Whitney's own are the backend's.
REPLICAS = {SamplerEngine.VLLM: "whitney.backends.vllm"}


def start(name: str, spec: BackendSpec) -> ServedBackend:
    """The backend called `name`, started with `spec`'s models loaded; InvalidInput naming `backend` for an
    unknown name or a backend whose package is not installed."""
    if name not in BACKENDS:
        raise InvalidInput(f"backend must be one of {sorted(BACKENDS)}, got {name!r}", field="backend")
    if spec.samplers.engine not in REPLICAS or spec.samplers.maximum == 0:
        return importlib.import_module(BACKENDS[name]).start_backend(spec)
    replicas = importlib.import_module(REPLICAS[spec.samplers.engine])
    inner = importlib.import_module(BACKENDS[name]).start_backend(replicas.without_replicas(spec))
    try:
        return replicas.with_replicas(inner, spec, on_ray=name == "ray")
    except BaseException:
        inner.close()
        raise
