"""The "ray" backend: each served model's trainer (and sampler replicas) in Ray actors, placed with the resources
`--worker-resources` gives (engine/ray_backend.py RayBackend)."""

from __future__ import annotations

from whitney.backends.ray.actor import Placement
from whitney.errors import InvalidInput
from whitney.protocol.backend import Backend, BackendSpec


def placements(spec: BackendSpec) -> list[Placement]:
    """Each served model's placement from `spec.worker_resources` (by the name given or served; default one CPU):
    a trainer given N > 1 GPUs, or shards:N, shards its base over N ranks, one device each."""
    served = {name for pair in spec.models for name in pair}
    unknown = set(spec.worker_resources) - served
    if unknown:
        raise InvalidInput(f"worker resources name models not served: {sorted(unknown)}", field="worker_resources")
    out = []
    for name, public in spec.models:
        given = dict(spec.worker_resources.get(name) or spec.worker_resources.get(public) or {})
        cpus, gpus = given.pop("cpus", 1.0), given.pop("gpus", 0.0)
        shards = given.pop("shards", gpus if gpus > 1 else 1)
        if shards != int(shards) or shards < 1 or (gpus > 1 and shards != gpus):
            raise InvalidInput(f"worker resources of {public}: shards must be a whole number >= 1 (and equal gpus "
                               f"when gpus > 1), got shards {shards} with gpus {gpus}", field="worker_resources")
        out.append(Placement(name, public, num_cpus=cpus, num_gpus=gpus / shards if gpus > 1 else gpus,
                             resources=given, samplers=spec.samplers, shards=int(shards)))
    return out


def start_backend(spec: BackendSpec) -> Backend:
    """The Ray backend (whitney/backends: "ray"): each model's workers placed as `spec.worker_resources` say."""
    try:
        import ray  # noqa: F401 (the optional dependency, checked before anything starts)
    except ImportError as e:
        raise InvalidInput(f"the ray backend needs Ray: pip install 'whitney[ray]' ({e})", field="backend") from None
    from whitney.backends.ray.proxy import RayBackend

    return RayBackend(spec.engine, placements(spec), spec.ray_address)
