"""RayBackend: the Backend over Ray actors, so base models live on a cluster's nodes and devices.

    control plane (one process)                  Ray cluster
    HTTP -> store -> Scheduler -> RayBackend ── ModelWorker "trainer" of model A: its runs' adapters,
                                            │   gradients and optimizer state; forward(_backward) etc.
                                            ├── ModelWorker "sampler" x K of model A: sample and
                                            │   compute_logprobs on frozen weights read from files
                                            └── ModelWorker "trainer" of model B (another node) ...

Every worker is an `InProcessBackend` (one `Engine`, one base model) inside a Ray actor, so its numbers
are the in-process engine's. What crosses the wire is the Backend's plain data (pickled dataclasses).

- Requests are validated here, from each model's `ModelInfo` (no round trip); a forward batch is split by
  base model and sent to each model's trainer at once.
- Sampler replicas (`samplers` per model) hold no runs: a run's sampler version N is the state file that
  `save_weights_for_sampler(run_id, path)` writes to a shared directory; every replica loads it (checksums
  verified) before the call returns, so any `sample` on N finds it everywhere and never sees newer trainer
  weights. A replica that restarts loads versions again on first use. With no replicas the trainer samples.
- Faults: a worker that dies (kill -9, a lost node) fails its in-flight calls with `WorkerLost`
  (`worker_lost`); Ray restarts the actor, which reloads its base model. A trainer's runs lived only in its
  memory: they are reported by `take_lost_runs` (the scheduler marks them interrupted; a new run resumes
  from a saved state). A heartbeat notices a worker that died while idle. Calls to a worker that is still
  restarting are refused at once with `Unavailable`, so nothing waits on it and other models go on.

Ray is an optional dependency (`pip install whitney[ray]`), imported only when this backend starts.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

from whitney.engine.backend import (Failure, InProcessBackend, ModelInfo, Weights, WorkerLost, adapter_bytes,
                                    raise_failure)
from whitney.engine.checkpoint import read_manifest
from whitney.engine.config import EngineConfig
from whitney.engine.lora import LoraConfig
from whitney.engine.optim import AdamParams
from whitney.engine.requests import ForwardRequest, ForwardResult, check_request
from whitney.engine.sampler import SampleResult, SamplingParams
from whitney.errors import InvalidInput, NotFound, Unavailable, WhitneyError

HEARTBEAT_SECONDS = 2.0  # how often an idle worker is asked whether it is the same process
SAMPLER_STEP_SECONDS = 0.05  # a replica decodes for this long per call (one step: the trainer, which trains too)


@dataclass(frozen=True)
class Placement:
    """Where one base model's workers go: Ray resources per worker and the number of sampler replicas."""

    model: str  # as given to --model: a name or a local directory every node reaches
    name: str  # the name it is served under (routes, runs)
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)  # custom Ray resources (e.g. a node's label)
    samplers: int = 0

    @staticmethod
    def parse_resources(spec: str) -> dict[str, float]:
        """"cpus:2,gpus:1,node_a:1" -> {"cpus": 2.0, "gpus": 1.0, "node_a": 1.0} (a clear error otherwise)."""
        out = {}
        for part in filter(None, spec.split(",")):
            key, sep, amount = part.partition(":")
            try:
                out[key.strip()] = float(amount)
            except ValueError:
                sep = ""
            if not sep or not key.strip() or out[key.strip()] < 0:
                raise InvalidInput(f"worker resources {spec!r}: each item is NAME:AMOUNT with AMOUNT >= 0 "
                                   "(cpus, gpus or a custom Ray resource)", field="worker_resources")
        return out


@dataclass
class _Raised:
    """A WhitneyError raised in a worker, carried back as data (the caller raises it again)."""

    failure: Failure


class ModelWorker:
    """One base model's engine in a Ray actor (trainer or sampler replica). Ray re-runs __init__ after a
    crash, so a restarted worker reloads its model by itself."""

    def __init__(self, config: EngineConfig, model: str, name: str):
        import ray
        import torch

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        # As many compute threads as the CPUs Ray gave this worker (its share of the node).
        torch.set_num_threads(max(1, int(ray.get_runtime_context().get_assigned_resources().get("CPU", 1))))
        self.backend = InProcessBackend.start(config, [])
        self.error: Failure | None = None
        try:
            self.info = self.backend.load_model(model, alias=name)
        except WhitneyError as e:  # answered by describe(): the operator's mistake, not a crash loop
            self.error = Failure.of(e)

    def describe(self) -> tuple[ModelInfo | _Raised, int, str]:
        """The model's info (or why it did not load), this process's id and its Ray node."""
        import ray

        info = _Raised(self.error) if self.error else self.info
        return info, os.getpid(), ray.get_runtime_context().get_node_id()

    def call(self, method: str, *args) -> Any:
        try:
            return getattr(self.backend, method)(*args)
        except WhitneyError as e:
            return _Raised(Failure.of(e))

    def sample_steps(self, seconds: float) -> list[tuple[str, SampleResult | Failure]]:
        """Decode steps until a request ends or `seconds` pass (0: one step); the requests that ended."""
        start = time.monotonic()
        while True:
            ended = self.backend.sample_step()
            if ended or not self.backend.sampling or time.monotonic() - start >= seconds:
                return ended

    def warm(self, checkpoint_path: str) -> None:
        """Load a frozen version (checksums verified) so the first sample on it does not wait."""
        self.backend.engine.resolve_weights(checkpoint_path=checkpoint_path)


@dataclass
class _Worker:
    handle: Any  # the Ray actor
    model: str  # served name
    role: str  # "trainer" or "sampler"
    pid: int = 0
    node: str = ""
    restarting: Any = None  # an ObjectRef of describe() while the actor restarts; None when usable
    ping: Any = None  # an outstanding heartbeat
    pinged_at: float = 0.0
    inflight: set[str] = field(default_factory=set)  # sample request ids
    stepping: Any = None  # an outstanding sample_steps call

    def __str__(self) -> str:
        return f"the {self.role} worker of {self.model!r} (pid {self.pid})"


class RayBackend:
    """The Backend over Ray actors (see the module docstring). Thread-safe between the scheduler's
    training thread and its sampling thread (`separate_sampling`)."""

    separate_sampling = True

    def __init__(self, config: EngineConfig, placements: list[Placement], address: str | None = None):
        import ray

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False,
                         runtime_env={"env_vars": {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}})
            except (ConnectionError, RuntimeError, ValueError) as e:
                raise InvalidInput(f"cannot start or reach a Ray cluster at {address or 'a new local instance'}: "
                                   f"{e}", field="ray_address") from None
        self.config = config
        self._lock = threading.RLock()
        self._trainers: dict[str, _Worker] = {}
        self._samplers: dict[str, list[_Worker]] = {}
        self._names: dict[str, str] = {}  # every name a model goes by (served name, --model) -> served name
        self._info: dict[str, ModelInfo] = {}
        self._run_model: dict[str, str] = {}
        self._versions: dict[tuple[str, int], str] = {}  # (run, version) -> its state file directory
        self._lost: list[str] = []
        actor = ray.remote(ModelWorker)
        try:
            for p in placements:
                options = dict(num_cpus=p.num_cpus, num_gpus=p.num_gpus, resources=p.resources or None,
                               max_restarts=-1, max_task_retries=0)
                self._names[p.model] = self._names[p.name] = p.name
                self._trainers[p.name] = _Worker(actor.options(**options).remote(config, p.model, p.name),
                                                 p.name, "trainer")
                self._samplers[p.name] = [_Worker(actor.options(**options).remote(config, p.model, p.name),
                                                  p.name, "sampler") for _ in range(p.samplers)]
            for worker in self._workers():
                info, worker.pid, worker.node = ray.get(worker.handle.describe.remote())
                if isinstance(info, _Raised):
                    raise_failure(info.failure)
                self._info[worker.model] = info
        except BaseException:
            self.close()
            raise

    # ---- workers ----------------------------------------------------------------------------

    def _workers(self) -> list[_Worker]:
        return [*self._trainers.values(), *(w for ws in self._samplers.values() for w in ws)]

    def _lose(self, worker: _Worker, error: BaseException) -> WorkerLost:
        """`worker` died: what it held is gone. Its runs are reported lost; it restarts (Ray)."""
        with self._lock:
            if worker.restarting is None:
                worker.restarting = worker.handle.describe.remote()
            worker.stepping = worker.ping = None
            if worker.role == "trainer":
                runs = [r for r, m in self._run_model.items() if m == worker.model]
                for run_id in runs:
                    del self._run_model[run_id]
                self._lost.extend(runs)
        return WorkerLost(f"{worker} died ({type(error).__name__}); Ray restarts it and reloads the base model")

    def _usable(self, worker: _Worker) -> bool:
        """False while the worker restarts (never waits for it)."""
        with self._lock:
            if worker.restarting is None:
                return True
            ready, _ = self._ray.wait([worker.restarting], timeout=0)
            if not ready:
                return False
            try:
                _, worker.pid, worker.node = self._ray.get(worker.restarting)
            except self._ray.exceptions.RayActorError:
                worker.restarting = worker.handle.describe.remote()
                return False
            worker.restarting = None
            return True

    def _get(self, worker: _Worker, ref) -> Any:
        """The result of a call on `worker`: a WhitneyError raised there is raised here, a death is WorkerLost."""
        try:
            result = self._ray.get(ref)
        except self._ray.exceptions.RayActorError as e:
            raise self._lose(worker, e) from None
        if isinstance(result, _Raised):
            raise_failure(result.failure)
        return result

    def _call(self, worker: _Worker, method: str, *args) -> Any:
        if not self._usable(worker):
            raise Unavailable(f"{worker} is restarting after a failure; try again shortly", field="base_model")
        return self._get(worker, worker.handle.call.remote(method, *args))

    def _trainer_of_run(self, run_id: str) -> _Worker:
        with self._lock:
            if run_id in self._lost:
                raise WorkerLost(f"run {run_id!r} was lost with its worker")
            if run_id not in self._run_model:
                raise NotFound(f"run {run_id!r} does not exist", field="run_id")
            return self._trainers[self._run_model[run_id]]

    def _model(self, base_model: str | None) -> str:
        name = self._names.get(base_model or next(iter(self._trainers)))
        if name is None:
            raise InvalidInput(f"base model {base_model!r} is not served here; served: {list(self._trainers)}",
                               field="base_model")
        return name

    def nodes(self) -> dict[str, list[str]]:
        """Each served model's workers' Ray node ids (trainer first)."""
        return {m: [w.node for w in (self._trainers[m], *self._samplers[m])] for m in self._trainers}

    def pids(self, model: str) -> list[int]:
        """The process ids of a model's workers (trainer first)."""
        return [w.pid for w in (self._trainers[model], *self._samplers[model])]

    # ---- the Backend ------------------------------------------------------------------------

    @property
    def models(self) -> dict[str, ModelInfo]:
        return dict(self._info)

    def adapter_bytes(self, base_model: str, lora: LoraConfig) -> int:
        return adapter_bytes(self._info[self._model(base_model)], lora, self.config.max_lora_rank)

    def validate(self, request: ForwardRequest, backward: bool) -> int:
        if request.run_id is None:
            model = self._model(request.base_model)
        else:
            model = self._trainer_of_run(request.run_id).model
        info = self._info[model]
        return sum(d.length for d in check_request(request, backward, info.vocab_size, info.max_context).datums)

    def create_run(self, run_id: str, base_model: str, lora: LoraConfig, resume_path: str | None = None,
                   resume_with_optimizer: bool = False) -> None:
        trainer = self._trainers[self._model(base_model)]
        self._call(trainer, "create_run", run_id, trainer.model, lora, resume_path, resume_with_optimizer)
        with self._lock:
            self._run_model[run_id] = trainer.model

    def delete_run(self, run_id: str) -> None:
        with self._lock:
            model = self._run_model.pop(run_id, None)
            if run_id in self._lost:
                self._lost.remove(run_id)
            for key in [k for k in self._versions if k[0] == run_id]:
                del self._versions[key]
        if model is not None:
            try:
                self._call(self._trainers[model], "delete_run", run_id)
            except (WorkerLost, Unavailable):
                pass  # gone with its worker

    def run_batch(self, requests: list[ForwardRequest], backward: bool) -> list[ForwardResult | Failure]:
        """Each base model's requests to its trainer, all models at once; results in request order."""
        out: list[ForwardResult | Failure | None] = [None] * len(requests)
        by_model: dict[str, list[int]] = {}
        for i, request in enumerate(requests):
            try:
                model = (self._model(request.base_model) if request.run_id is None
                         else self._trainer_of_run(request.run_id).model)
            except (WhitneyError, WorkerLost) as e:
                out[i] = Failure.of(e)
                continue
            by_model.setdefault(model, []).append(i)
        calls = []
        for model, indices in by_model.items():
            trainer = self._trainers[model]
            if not self._usable(trainer):
                for i in indices:
                    out[i] = Failure.of(Unavailable(f"{trainer} is restarting after a failure; try again shortly"))
                continue
            batch = [requests[i] for i in indices]
            calls.append((trainer, indices, trainer.handle.call.remote("run_batch", batch, backward)))
        for trainer, indices, ref in calls:
            try:
                results = self._get(trainer, ref)
            except WorkerLost as e:
                results = [Failure.of(e)] * len(indices)
            for i, result in zip(indices, results):
                out[i] = result
        return out  # type: ignore[return-value]

    def commit_gradients(self, run_id: str, stage: str) -> None:
        self._call(self._trainer_of_run(run_id), "commit_gradients", run_id, stage)

    def discard_gradients(self, run_id: str, stage: str) -> None:
        try:
            self._call(self._trainer_of_run(run_id), "discard_gradients", run_id, stage)
        except (WorkerLost, Unavailable, NotFound):
            pass  # nothing staged survives a lost worker

    def optim_step(self, run_id: str, params: AdamParams) -> dict[str, float]:
        return self._call(self._trainer_of_run(run_id), "optim_step", run_id, params)

    def save_state(self, run_id: str, path: str, include_optimizer: bool = True) -> None:
        self._call(self._trainer_of_run(run_id), "save_state", run_id, path, include_optimizer)

    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None:
        self._call(self._trainer_of_run(run_id), "load_state", run_id, path, with_optimizer)

    def save_weights(self, run_id: str, path: str, merge: bool = False) -> None:
        self._call(self._trainer_of_run(run_id), "save_weights", run_id, path, merge)

    def export_lora(self, run_id: str, path: str) -> None:
        self._call(self._trainer_of_run(run_id), "export_lora", run_id, path)

    def save_weights_for_sampler(self, run_id: str, path: str) -> int:
        """The trainer freezes version N and writes it to `path`; every replica loads it before this returns."""
        trainer = self._trainer_of_run(run_id)
        version = self._call(trainer, "save_weights_for_sampler", run_id, path)
        replicas = [w for w in self._samplers[trainer.model] if self._usable(w)]
        for worker, ref in [(w, w.handle.warm.remote(path)) for w in replicas]:
            try:
                self._get(worker, ref)
            except WorkerLost:
                pass  # it loads the version from the file on first use once restarted
        with self._lock:
            self._versions[(run_id, version)] = path
        return version

    # ---- sampling and scoring (the scheduler's sampling thread) --------------------------------

    def _sampling_worker(self, weights: Weights) -> tuple[_Worker, Weights]:
        """The least busy usable replica of the weights' model, and the weights as it names them (a run's
        version by its file); the trainer when the model has no replicas."""
        if weights.run_id is not None:
            trainer = self._trainer_of_run(weights.run_id)
            model = trainer.model
            if self._samplers[model]:
                with self._lock:
                    path = self._versions.get((weights.run_id, weights.version))
                if path is None:
                    raise NotFound(f"run {weights.run_id!r} has no sampler version {weights.version}",
                                   field="version")
                weights = Weights(checkpoint_path=path)
        elif weights.checkpoint_path is not None:
            model = self._model(read_manifest(weights.checkpoint_path)["base_model"])
        else:
            model = self._model(weights.base_model)
            weights = replace(weights, base_model=model)
        candidates = [w for w in self._samplers[model] or [self._trainers[model]] if self._usable(w)]
        if not candidates:
            raise Unavailable(f"every sampling worker of {model!r} is restarting after a failure; try again shortly",
                              field="base_model")
        return min(candidates, key=lambda w: len(w.inflight)), weights

    def compute_logprobs(self, sequences: list[list[int]], weights: Weights) -> list[list[float | None]]:
        worker, weights = self._sampling_worker(weights)
        return self._call(worker, "compute_logprobs", sequences, weights)

    def submit_sample(self, request_id: str, prompt: list[int], params: SamplingParams, weights: Weights) -> None:
        worker, weights = self._sampling_worker(weights)
        self._call(worker, "submit_sample", request_id, prompt, params, weights)
        with self._lock:
            worker.inflight.add(request_id)

    def sample_step(self) -> list[tuple[str, SampleResult | Failure]]:
        """Keep one decode call outstanding on every worker with requests in flight; wait briefly for one
        to answer; the requests that ended (those of a worker that died: WorkerLost)."""
        with self._lock:
            busy = [w for w in self._workers() if w.inflight]
            for w in busy:
                if w.stepping is None:
                    seconds = SAMPLER_STEP_SECONDS if w.role == "sampler" else 0.0
                    w.stepping = w.handle.sample_steps.remote(seconds)
            pending = {w.stepping: w for w in busy}
        if not pending:
            return []
        ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=SAMPLER_STEP_SECONDS)
        ended: list[tuple[str, SampleResult | Failure]] = []
        for ref in ready:
            worker = pending[ref]
            worker.stepping = None
            try:
                ended += self._get(worker, ref)
            except WorkerLost as e:
                ended += [(request_id, Failure.of(e)) for request_id in worker.inflight]
            with self._lock:
                worker.inflight -= {request_id for request_id, _ in ended}
        return ended

    # ---- faults and shutdown ------------------------------------------------------------------

    def take_lost_runs(self) -> list[str]:
        """Runs lost with their trainer since the last call. Also the heartbeat: a trainer whose process
        changed (it died while idle and Ray restarted it) lost its runs too."""
        now = time.monotonic()
        for worker in list(self._trainers.values()):
            if worker.restarting is not None:
                continue
            if worker.ping is None:
                if now - worker.pinged_at >= HEARTBEAT_SECONDS:
                    worker.ping, worker.pinged_at = worker.handle.describe.remote(), now
                continue
            ready, _ = self._ray.wait([worker.ping], timeout=0)
            if not ready:
                continue
            try:
                _, pid, _ = self._ray.get(worker.ping)
                worker.ping = None
                if pid != worker.pid:
                    self._lose(worker, RuntimeError(f"restarted as pid {pid}"))
            except self._ray.exceptions.RayActorError as e:
                self._lose(worker, e)
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def close(self) -> None:
        """Stop the workers (and the local Ray instance this backend started)."""
        for worker in self._workers():
            try:
                self._ray.kill(worker.handle, no_restart=True)
            except Exception:
                pass
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
