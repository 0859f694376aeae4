"""The Ray backend's supervisor: it starts every model's workers, notices the ones that die, restarts them, and
keeps which trainer holds each run, so the runs a dead trainer held are reported lost.

A worker is usable, or restarting (its actors describing themselves; the ranks of a sharded trainer then form
their process group and load their shards again). Restarting is never waited for while serving: `usable` polls
it, and a call to a worker that is restarting is refused at once with `Unavailable`. A worker dies (kill -9, a
lost node) in a call, which fails with `WorkerLost`, or while idle, which the heartbeat in `take_lost_runs`
notices (its process changed). Ray restarts a dead actor; the surviving ranks of a sharded trainer are killed so
that they restart with it. A trainer's runs lived only in its memory: they are lost with it.

The ranks of a sharded trainer are placed together: one Ray placement group per trainer, a bundle of its worker
resources per rank, packed onto as few nodes as hold them and spread over more where one does not (`PACK`). Ray
reserves the bundles for the trainer's life, so a rank that dies restarts in its own bundle, and the ranks meet
at rank 0's node address.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from typing import TypeVar

from whitney.backends.ray.actor import ModelWorker
from whitney.backends.ray.calls import CHECK_THREADS, CHECKS, Call, Raised
from whitney.backends.ray.placement import Placement
from whitney.backends.ray.workers import Role, Worker
from whitney.errors import InvalidInput, NotFound, Unavailable
from whitney.heap import ARENAS
from whitney.protocol.backend import ModelInfo, WorkerLost, raise_failure
from whitney.protocol.config import EngineConfig

HEARTBEAT_SECONDS = 2.0  # how often an idle trainer is asked whether it is the same process
PLACE_SECONDS = 120.0  # how long the ranks of a sharded trainer may wait for the cluster to hold their bundles

T = TypeVar("T")


class Supervisor:
    """Every worker of the placements, their restarts, and the runs on each trainer (thread-safe)."""

    def __init__(self, config: EngineConfig, placements: list[Placement], address: str | None = None,
                 service: str | None = None):
        import ray

        self.ray = ray
        self.service = service  # a highly available service's: its workers are named, shared and outlive us
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False, namespace=service)
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise InvalidInput(f"cannot start or reach a Ray cluster at {address or 'a new local instance'}: "
                                   f"{e}", field="ray_address") from None
        self.lock = threading.RLock()
        self.trainers: dict[str, Worker] = {}
        self.samplers: dict[str, list[Worker]] = {}
        self.models: dict[str, ModelInfo] = {}
        self._names: dict[str, str] = {}  # every name a model goes by (served name, --model) -> served name
        self._run_model: dict[str, str] = {}
        self._lost: list[str] = []
        self.placements = {p.name: p for p in placements}
        self._groups: dict[str, object] = {}  # a sharded trainer's Ray placement group, by model
        self._config = config
        self._actor_class = ray.remote(concurrency_groups={CHECKS: CHECK_THREADS})(ModelWorker)  # heavy calls beside
        try:
            for p in placements:
                if p.shards > 1:
                    self._groups[p.name] = self._place(p)
                self._names[p.model] = self._names[p.name] = p.name
                self.trainers[p.name] = Worker([self._actor(p, rank, p.shards, f"trainer/{rank}")
                                                for rank in range(p.shards)], p.name, Role.TRAINER)
                self.samplers[p.name] = [Worker([self._actor(p, name=f"sampler/{i}")], p.name, Role.SAMPLER)
                                         for i in range(p.samplers)] + self._elastic_replicas(p)
            for worker in self.workers():
                self._begin(worker)
            for worker in self.workers():
                info = self._started(worker)
                if isinstance(info, Raised):
                    raise_failure(info.failure)
                self.models[worker.model] = info
        except BaseException:
            self.close()
            raise

    def _actor(self, p: Placement, rank: int = 0, shards: int = 1, name: str | None = None):
        """A new actor of the model's: a rank of its trainer, or (rank 0 of 1) a sampler replica. A highly available
        service's is named (`name`, under the model's) and detached: the one another member started is found and
        shared, and it outlives every member."""
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1"),  # every worker's, whoever started Ray
               # glibc reads it as the process starts, before Ray's threads make arenas of their own (heap.py)
               "MALLOC_ARENA_MAX": str(ARENAS)}
        options = p.actor_options(env)
        if self.service is not None:
            options.update(name=f"{p.name}/{name or 'sampler/' + uuid.uuid4().hex[:12]}", namespace=self.service,
                           lifetime="detached", get_if_exists=True)
        if shards > 1:  # its bundle of the trainer's placement group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                placement_group=self._groups[p.name], placement_group_bundle_index=rank)
        return self._actor_class.options(**options).remote(self._config, p.model, p.name, rank, shards)

    def _place(self, p: Placement):
        """A placement group of the trainer's ranks, one bundle each, reserved on the cluster (PACK: as few nodes
        as hold them). InvalidInput where the cluster cannot hold them within PLACE_SECONDS. A highly available
        service's is named and detached: the one another member reserved is found and shared."""
        from ray.util.placement_group import get_placement_group, placement_group, remove_placement_group

        if self.service is not None:
            try:
                return get_placement_group(f"{p.name}/ranks")
            except ValueError:  # none yet: this member reserves it
                pass
            group = placement_group([p.bundle()] * p.shards, strategy="PACK", name=f"{p.name}/ranks",
                                    lifetime="detached")
        else:
            group = placement_group([p.bundle()] * p.shards, strategy="PACK")
        try:
            self.ray.get(group.ready(), timeout=PLACE_SECONDS)
        except self.ray.exceptions.GetTimeoutError:
            remove_placement_group(group)
            raise InvalidInput(f"the cluster cannot place the {p.shards} ranks of {p.name}, each {p.bundle()}, "
                               f"within {PLACE_SECONDS:.0f} s", field="worker_resources") from None
        return group

    def _elastic_replicas(self, p: Placement) -> list[Worker]:
        """A highly available service's elastic replicas of the model that another member started (named under the
        model, past its fixed ones), shared; none otherwise."""
        if self.service is None:
            return []
        fixed = {f"{p.name}/sampler/{i}" for i in range(p.samplers)}
        names = [a["name"] for a in self.ray.util.list_named_actors(all_namespaces=True)
                 if a.get("namespace") == self.service and a["name"].startswith(f"{p.name}/sampler/")
                 and a["name"] not in fixed]
        return [Worker([self.ray.get_actor(n, namespace=self.service)], p.name, Role.SAMPLER) for n in sorted(names)]

    def add_sampler(self, model: str) -> Worker:
        """One more replica of the model (elastic): it starts as a restart does, never waited for here."""
        worker = Worker([self._actor(self.placements[model])], model, Role.SAMPLER)
        with self.lock:
            self._begin(worker)
            self.samplers[model].append(worker)
        return worker

    def remove_sampler(self, worker: Worker) -> None:
        """Stop a replica (elastic, idle): its actor ends and Ray frees its resources."""
        with self.lock:
            self.samplers[worker.model].remove(worker)
        for actor in worker.ranks:
            self.ray.kill(actor, no_restart=True)

    def workers(self) -> list[Worker]:
        return [*self.trainers.values(), *(w for ws in self.samplers.values() for w in ws)]

    def nodes(self) -> dict[str, list[str]]:
        """Each served model's workers' Ray node ids (trainer first)."""
        return {m: [w.node for w in (self.trainers[m], *self.samplers[m])] for m in self.trainers}

    def placement_group(self, model: str):
        """The Ray placement group holding a sharded trainer's ranks (None: an unsharded trainer)."""
        return self._groups.get(model)

    def pids(self, model: str) -> list[int]:
        """The process ids of a model's workers: the trainer's ranks, then each replica."""
        return [pid for w in (self.trainers[model], *self.samplers[model]) for pid in w.pids]

    # ---- models and runs ----------------------------------------------------------------------

    def model(self, base_model: str | None) -> str:
        """The served name of a model by any name it goes by (None: the first served)."""
        name = self._names.get(base_model or next(iter(self.trainers)))
        if name is None:
            raise InvalidInput(f"base model {base_model!r} is not served here; served: {list(self.trainers)}",
                               field="base_model")
        return name

    def trainer_of_run(self, run_id: str) -> Worker:
        with self.lock:
            if run_id in self._lost:
                raise WorkerLost(f"run {run_id!r} was lost with its worker")
            if run_id not in self._run_model:
                raise NotFound(f"run {run_id!r} does not exist", field="run_id")
            return self.trainers[self._run_model[run_id]]

    def trainer(self, run_id: str | None, base_model: str | None = None) -> Worker:
        """The trainer of a run, or without one of a base model."""
        return self.trainer_of_run(run_id) if run_id is not None else self.trainers[self.model(base_model)]

    def add_run(self, run_id: str, model: str) -> None:
        with self.lock:
            self._run_model[run_id] = model

    def drop_run(self, run_id: str) -> str | None:
        """Forget a run (lost or not); the model whose trainer still holds it, if any."""
        with self.lock:
            if run_id in self._lost:
                self._lost.remove(run_id)
            return self._run_model.pop(run_id, None)

    def take_lost_runs(self) -> list[str]:
        """Runs lost with their trainer since the last call. Also the heartbeat: a trainer whose process
        changed (it died while idle and Ray restarted it) lost its runs too."""
        now = time.monotonic()
        for worker in list(self.trainers.values()):
            with self.lock:  # a call on another thread may lose the worker (and drop its ping) meanwhile
                self._heartbeat(worker, now)
        with self.lock:
            lost, self._lost = self._lost, []
        return lost

    def _heartbeat(self, worker: Worker, now: float) -> None:
        """Ping an idle trainer every HEARTBEAT_SECONDS (never waiting): a new pid, or no answer, is a death."""
        if worker.restarting is not None:
            return
        if worker.ping is None:
            if now - worker.pinged_at >= HEARTBEAT_SECONDS:
                worker.ping, worker.pinged_at = [r.describe.remote() for r in worker.ranks], now
            return
        ready, _ = self.ray.wait(worker.ping, num_returns=len(worker.ping), timeout=0)
        if len(ready) < len(worker.ping):
            return
        try:
            pids = [d[1] for d in self.ray.get(worker.ping)]
            worker.ping = None
            if pids != worker.pids:
                self.lose(worker, RuntimeError(f"restarted as pids {pids}"))
        except self.ray.exceptions.RayActorError as e:
            self.lose(worker, e)

    # ---- calls --------------------------------------------------------------------------------

    def call(self, worker: Worker, call: Call[T]) -> T:
        """The call on the worker (every rank); Unavailable at once while it restarts."""
        if not self.usable(worker):
            raise Unavailable(f"{worker} is restarting after a failure; try again shortly", field="base_model")
        return self.result(worker, worker.submit(call))

    def result(self, worker: Worker, refs: list):
        """The answer to a call submitted to the worker: a WhitneyError raised there is raised here, a death is
        WorkerLost (and the worker restarts)."""
        try:
            answer = worker.collect(self.ray, refs)
        except worker.deaths(self.ray) as e:
            raise self.lose(worker, e) from None
        if isinstance(answer, Raised):
            raise_failure(answer.failure)
        return answer

    def each_trainer(self, call: Call[T]) -> list[T]:
        """The call's answer from each trainer; one lost or restarting has no runs to count."""
        answers = []
        for worker in list(self.trainers.values()):
            try:
                answers.append(self.call(worker, call))
            except (WorkerLost, Unavailable):
                pass
        return answers

    # ---- restarts -----------------------------------------------------------------------------

    def _begin(self, worker: Worker) -> None:
        """Begin (re)starting: describe each actor; the ranks of a sharded trainer form their group first. The
        refs of calls still out (heartbeats, decode steps) answer for the process that died: dropped."""
        worker.generation += 1
        worker.stepping = worker.ping = None
        worker.joining = len(worker.ranks) > 1
        worker.restarting = [r.describe.remote() for r in worker.ranks]

    def _started(self, worker: Worker) -> ModelInfo | Raised | None:
        """Wait for a start begun by _begin (at startup only: never while serving). The ranks of a sharded trainer
        another member of a highly available service started have joined already."""
        described = self.ray.get(worker.restarting)
        if worker.joining and any(d[0] is None for d in described):
            address = self.ray.get(worker.ranks[0].address.remote())
            described = self.ray.get([r.join.remote(address) for r in worker.ranks])
        worker.restarting, worker.joining = None, False
        worker.pids, worker.node = [d[1] for d in described], described[0][2]
        return described[0][0]

    def lose(self, worker: Worker, error: BaseException) -> WorkerLost:
        """`worker` died (or one rank of it): what it held is gone. Its runs are reported lost; it restarts
        (Ray restarts a dead actor; the surviving ranks of a sharded trainer are restarted with it)."""
        with self.lock:
            if worker.restarting is None:
                if len(worker.ranks) > 1:
                    for rank in worker.ranks:
                        self.ray.kill(rank, no_restart=False)
                self._begin(worker)
            if worker.role == Role.TRAINER:
                runs = [r for r, m in self._run_model.items() if m == worker.model]
                for run_id in runs:
                    del self._run_model[run_id]
                self._lost.extend(runs)
        return WorkerLost(f"{worker} died ({type(error).__name__}); Ray restarts it and reloads the base model")

    def usable(self, worker: Worker) -> bool:
        """False while the worker restarts (never waits for it)."""
        with self.lock:
            if worker.restarting is None:
                return True
            ready, _ = self.ray.wait(worker.restarting, num_returns=len(worker.restarting), timeout=0)
            if len(ready) < len(worker.restarting):
                return False
            try:
                described = self.ray.get(worker.restarting)
            except self.ray.exceptions.RayError:
                self._begin(worker)
                return False
            if worker.joining:  # every rank is back: they form their group and load their shards
                worker.joining = False
                address = self.ray.get(worker.ranks[0].address.remote())
                worker.restarting = [r.join.remote(address) for r in worker.ranks]
                return False
            worker.pids, worker.node = [d[1] for d in described], described[0][2]
            worker.restarting = None
            return True

    def close(self) -> None:
        """Stop the workers (and the local Ray instance started here). A highly available service's workers are
        its, not this member's: they stay (`ray stop`, or killing its actors, ends them)."""
        if self.service is not None:
            if self._owns_ray and self.ray.is_initialized():
                self.ray.shutdown()
            return
        for actor in (a for w in self.workers() for a in w.ranks):
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._groups and self.ray.is_initialized():
            from ray.util.placement_group import remove_placement_group

            for group in self._groups.values():
                remove_placement_group(group)
        if self._owns_ray and self.ray.is_initialized():
            self.ray.shutdown()
