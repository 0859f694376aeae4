"""Where each served model's workers go on a Ray cluster (torch-free: the CLI parses `--worker-resources` with it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from whitney.errors import InvalidInput
from whitney.protocol.backend import BackendSpec


@dataclass(frozen=True)
class Placement:
    """Where one base model's workers go: Ray resources per worker and the number of sampler replicas."""

    model: str  # as given to --model: a name or a local directory every node reaches
    name: str  # the name it is served under (routes, runs)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (e.g. a node's label)
    samplers: int = 0  # replicas always running
    max_samplers: int | None = None  # elastic: up to this many while samples are asked for (None: `samplers`)
    sampler_idle_seconds: float = 300.0  # an elastic replica idle this long stops
    shards: int = 1  # the trainer's ranks: its base sharded over them (FSDP2), each rank these resources

    @staticmethod
    def parse_resources(spec: str) -> dict[str, float]:
        """"cpus:2,gpus:1,node_a:1" -> {"cpus": 2.0, "gpus": 1.0, "node_a": 1.0} (a clear error otherwise)."""
        out = {}
        for part in filter(None, spec.split(",")):
            key, sep, amount = part.partition(":")
            try:
                value = float(amount)
            except ValueError:
                value = -1.0
            if not sep or not key.strip() or value < 0:
                raise InvalidInput(f"worker resources {spec!r}: each item is NAME:AMOUNT with AMOUNT >= 0 "
                                   "(cpus, gpus or a custom Ray resource)", field="worker_resources")
            out[key.strip()] = value
        return out

    def actor_options(self, env: dict[str, str]) -> dict:
        """Ray's options for each of this model's actors: restarted without end after a crash, a call to a dead
        actor never retried (it fails as WorkerLost instead), `env` in every worker process."""
        return dict(num_cpus=self.num_cpus, num_gpus=self.num_gpus, resources=self.resources or None,
                    max_restarts=-1, max_task_retries=0, runtime_env={"env_vars": env})

    def bundle(self) -> dict[str, float]:
        """One worker's resources as a bundle of a Ray placement group (a sharded trainer's: one per rank)."""
        return {k: v for k, v in {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}.items() if v}


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
                             resources=given, samplers=spec.samplers.minimum, max_samplers=spec.samplers.maximum,
                             sampler_idle_seconds=spec.samplers.idle_seconds, shards=int(shards)))
    return out
