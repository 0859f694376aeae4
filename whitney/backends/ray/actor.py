"""What runs on the cluster for the Ray backend: a model's placement, and the worker inside each Ray actor.

A `ModelWorker` is one process's engine for one base model: a trainer, a sampler replica, or one rank of
a trainer whose base is sharded over several ranks. It answers the Backend's calls by name (`call`), so
`RayBackend` (ray_backend.py) forwards the same plain data the scheduler hands it; a WhitneyError comes
back as data (`Raised`), never as an exception through Ray.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from whitney.backends.in_process import InProcessBackend
from whitney.engine.threads import ComputeThreads
from whitney.errors import InvalidInput, WhitneyError
from whitney.protocol.backend import Failure, ModelInfo
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampleProgress, SampleResult


@dataclass(frozen=True)
class Placement:
    """Where one base model's workers go: Ray resources per worker and the number of sampler replicas."""

    model: str  # as given to --model: a name or a local directory every node reaches
    name: str  # the name it is served under (routes, runs)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (e.g. a node's label)
    samplers: int = 0
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


@dataclass
class Raised:
    """A WhitneyError raised in a worker, carried back as data (the caller raises it again)."""

    failure: Failure


class ModelWorker:
    """One base model's engine in a Ray actor: a sampler replica, a trainer, or one rank of a trainer whose
    base is sharded over `shards` ranks (engine/sharded.py; every rank gets every call). Ray re-runs
    __init__ after a crash: an unsharded worker reloads its model by itself, a rank waits for `join`."""

    def __init__(self, config: EngineConfig, model: str, name: str, rank: int = 0, shards: int = 1):
        import ray

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # Compute threads as --threads says, the CPUs Ray gave this worker (its share of the node) its ceiling;
        # without a setting, as many as those CPUs.
        cpus = max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1)))
        self.threads = ComputeThreads.of(cpus if config.threads is None else config.threads, cpus)
        self.config, self.model, self.name, self.rank, self.shards = config, model, name, rank, shards
        self.backend: InProcessBackend | None = None
        self.info: ModelInfo | None = None
        self.error: Failure | None = None
        if shards == 1:
            self._load(InProcessBackend.start(config, [], self.threads))

    def _load(self, backend: InProcessBackend) -> None:
        self.backend = backend
        try:
            self.info = backend.load_model(self.model, alias=self.name)
        except WhitneyError as e:  # answered by describe(): the operator's mistake, not a crash loop
            self.error = Failure.of(e)

    def address(self) -> str:
        """Rank 0: where the ranks of a sharded trainer meet (this node, a free port)."""
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def join(self, init_method: str) -> tuple[ModelInfo | Raised | None, int, str]:
        """Form the process group with the other ranks, then load this rank's shard of the base."""
        from datetime import timedelta

        import torch
        import torch.distributed as dist

        from whitney.engine.training.sharded import ShardedEngine

        cuda = self.config.device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(0)  # Ray shows each rank only its own device
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=self.rank,
                                world_size=self.shards, timeout=timedelta(seconds=120))
        engine_settings = asdict(self.config)
        del engine_settings["threads"]  # the process's, set in __init__
        self._load(InProcessBackend(ShardedEngine(**engine_settings), self.threads))
        return self.describe()

    def describe(self) -> tuple[ModelInfo | Raised | None, int, str]:
        """The model's info (or why it did not load; None: a rank not joined yet), its pid and Ray node."""
        import ray

        info = Raised(self.error) if self.error else self.info
        return info, os.getpid(), ray.get_runtime_context().get_node_id()

    def call(self, method: str, *args) -> Any:
        try:
            return getattr(self.backend, method)(*args)
        except WhitneyError as e:
            return Raised(Failure.of(e))

    def sample_steps(self, seconds: float) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        """Decode steps until a request ends or `seconds` pass (0: one step): the streaming requests'
        progress over those steps (one report each), then the requests that ended (whose results hold
        every token, so a request that ended reports no progress)."""
        start = time.monotonic()
        progress: dict[str, SampleProgress] = {}
        while True:
            ended = []
            for request_id, outcome in self.backend.sample_step():
                if not isinstance(outcome, SampleProgress):
                    ended.append((request_id, outcome))
                elif request_id in progress:
                    progress[request_id].extend(outcome)
                else:
                    progress[request_id] = outcome
            if ended or not self.backend.sampling or time.monotonic() - start >= seconds:
                done = {request_id for request_id, _ in ended}
                return [(r, p) for r, p in progress.items() if r not in done] + ended

    def warm(self, checkpoint_path: str) -> None:
        """Load a frozen version (checksums verified) so the first sample on it does not wait."""
        self.backend.engine.resolve_weights(checkpoint_path=checkpoint_path)
