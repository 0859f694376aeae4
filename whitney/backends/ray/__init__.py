"""The "ray" backend: each served model's trainer (and sampler replicas) in Ray actors, placed with the resources
`--worker-resources` gives. proxy.py is the Backend (a translation to typed calls, calls.py), supervisor.py starts
and restarts the workers (workers.py), sampling.py places sampling on replicas, actor.py runs in each actor."""

from __future__ import annotations

from whitney.backends.ray.placement import Placement, placements
from whitney.errors import InvalidInput
from whitney.protocol.backend import BackendSpec, ServedBackend

__all__ = ["Placement", "placements", "start_backend"]


def start_backend(spec: BackendSpec) -> ServedBackend:
    """The Ray backend (whitney/backends: "ray"): each model's workers placed as `spec.worker_resources` say."""
    try:
        import ray  # noqa: F401 (the optional dependency, checked before anything starts)
    except ImportError as e:
        raise InvalidInput(f"the ray backend needs Ray: pip install 'whitney[ray]' ({e})", field="backend") from None
    from whitney.backends.ray.proxy import RayBackend

    return RayBackend(spec.engine, placements(spec), spec.ray_address, spec.service)
