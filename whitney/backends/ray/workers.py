"""A worker as the control plane holds it: one Ray actor (actor.py `ModelWorker`), or the ranks of a trainer
whose base is sharded over several actors, which get every call (SPMD) and answer through rank 0."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from whitney.backends.ray.calls import CHECKS, Call


class Role(str, Enum):
    TRAINER = "trainer"  # a model's runs: adapters, gradients, optimizer state; samples when it has no replicas
    SAMPLER = "sampler"  # a replica: samples and scores on frozen weights read from files, holds no runs


@dataclass
class Worker:
    """A trainer or a sampler replica: its actors (rank 0 first), and where the supervisor has it."""

    ranks: list  # the Ray actor handles
    model: str  # served name
    role: Role
    pids: list[int] = field(default_factory=list)
    node: str = ""  # rank 0's Ray node
    restarting: list | None = None  # refs of describe()/join() while (re)starting; None when usable
    generation: int = 0  # (re)starts begun: what was sent before the latest one went to a process that died
    joining: bool = False  # the ranks restarted and must form their process group again
    ping: list | None = None  # outstanding heartbeats
    pinged_at: float = 0.0
    inflight: dict[str, int] = field(default_factory=dict)  # sample request id -> the generation it went to
    stepping: list | None = None  # an outstanding SampleSteps call (on every rank)
    idle_since: float = field(default_factory=time.monotonic)  # a replica's last moment with samples (elastic)

    @property
    def pid(self) -> int:
        return self.pids[0] if self.pids else 0

    def __str__(self) -> str:
        ranks = f", {len(self.ranks)} ranks" if len(self.ranks) > 1 else ""
        return f"the {self.role.value} worker of {self.model!r} (pid {self.pid}{ranks})"

    def submit(self, call: Call) -> list:
        """The same call on every rank; their refs, rank 0's first. A heavy call goes to the ranks' CHECKS threads,
        beside the calls in turn."""
        run = [rank.run.options(concurrency_group=CHECKS) if call.heavy else rank.run for rank in self.ranks]
        return [method.remote(call) for method in run]

    def collect(self, ray, refs: list) -> Any:
        """Rank 0's answer to a call made on every rank. Each rank's answer is awaited as it comes, so a rank
        that died is noticed without waiting on its peers (which wait on it); raises what Ray raises then."""
        pending, answers = list(refs), {}
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            answers[ready[0]] = ray.get(ready[0])
        return answers[refs[0]]

    def deaths(self, ray) -> type[Exception]:
        """What Ray raises for a call to this worker when it died: an actor's death, or any rank's failure for a
        sharded trainer (its process group is broken)."""
        return ray.exceptions.RayError if len(self.ranks) > 1 else ray.exceptions.RayActorError
