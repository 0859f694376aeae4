"""What runs inside each Ray actor of the Ray backend: a `ModelWorker`.

A `ModelWorker` is one process's engine for one base model: a trainer, a sampler replica, or one rank of a
trainer whose base is sharded over several ranks. It runs the calls the proxy sends (calls.py: one type per
operation) on its `InProcessBackend`, so its numbers are the in-process backend's; a WhitneyError comes back as
data (`Raised`), never as an exception through Ray. Its other methods are its own lifecycle: `describe` (what
loaded, in which process), and for the ranks of a sharded trainer `address` and `join`.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import TypeVar

from whitney.backends.in_process import InProcessBackend
from whitney.backends.ray.calls import Call, Raised
from whitney.engine.threads import ComputeThreads
from whitney.errors import WhitneyError
from whitney.priority import lower_this_thread
from whitney.ports import free_port
from whitney.protocol.backend import Failure, ModelInfo, WorkerLost
from whitney.protocol.config import EngineConfig

T = TypeVar("T")


class ModelWorker:
    """One base model's engine in a Ray actor: a sampler replica, a trainer, or one rank of a trainer whose
    base is sharded over `shards` ranks (engine/training/sharded.py; every rank gets every call). Ray re-runs
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

    def run(self, call: Call[T]) -> T | Raised:
        """The call on this worker's backend: its answer, or the WhitneyError it raised as data (or the
        WorkerLost: a run whose paged-out state could not be read back). A heavy call runs on a CHECKS thread,
        beside the others, at a lowered CPU priority."""
        if call.heavy:
            lower_this_thread()  # one of the CHECKS group's threads: lowered for good
        try:
            return call.on(self.backend)
        except (WhitneyError, WorkerLost) as e:
            return Raised(Failure.of(e))

    def describe(self) -> tuple[ModelInfo | Raised | None, int, str]:
        """The model's info (or why it did not load; None: a rank not joined yet), its pid and Ray node."""
        import ray

        info = Raised(self.error) if self.error else self.info
        return info, os.getpid(), ray.get_runtime_context().get_node_id()

    def address(self) -> str:
        """Rank 0: where the ranks of a sharded trainer meet (this node, a free port)."""
        import ray

        return f"tcp://{ray.util.get_node_ip_address()}:{free_port('')}"

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
