"""RayBackend: the Backend over Ray actors, so base models live on a cluster's nodes and devices.

    control plane (one process)                  Ray cluster
    HTTP -> store -> Scheduler -> RayBackend ── ModelWorker "trainer" of model A: its runs' adapters,
                                            │   gradients and optimizer state; forward(_backward) etc.
                                            ├── ModelWorker "sampler" x K of model A: sample and
                                            │   compute_logprobs on frozen weights read from files
                                            └── ModelWorker "trainer" of model B (another node) ...

Every worker is an `InProcessBackend` (one `Engine`, one base model) inside a Ray actor (`ModelWorker`,
ray_worker.py), so its numbers are the in-process engine's. What crosses the wire is the Backend's plain
data (pickled dataclasses). A trainer given several devices (`Placement.shards`) is that many actors, one
rank each of a `ShardedEngine` (engine/sharded.py): every call goes to every rank, rank 0 answers.

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

from whitney.backends.in_process import adapter_bytes
from whitney.backends.ray.actor import ModelWorker, Placement, Raised
from whitney.engine.families import chat
from whitney.engine.losses.builtin import LossMethods
from whitney.engine.training.checkpoint import read_manifest
from whitney.engine.training.requests import check_request
from whitney.errors import InvalidInput, NotFound, Unavailable, WhitneyError
from whitney.protocol.backend import Failure, ModelInfo, Weights, WorkerLost, raise_failure
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, ForwardRequest, ForwardResult, LoraConfig

HEARTBEAT_SECONDS = 2.0  # how often an idle worker is asked whether it is the same process
SAMPLER_STEP_SECONDS = 0.05  # a replica decodes for this long per call (one step: the trainer, which trains too)


@dataclass
class _Worker:
    """A trainer or sampler replica: one Ray actor, or the ranks of a sharded trainer (rank 0 first)."""

    ranks: list  # the Ray actors
    model: str  # served name
    role: str  # "trainer" or "sampler"
    pids: list[int] = field(default_factory=list)
    node: str = ""  # rank 0's Ray node
    restarting: list | None = None  # refs of describe()/join() while (re)starting; None when usable
    joining: bool = False  # the ranks restarted and must form their process group again
    ping: list | None = None  # outstanding heartbeats
    pinged_at: float = 0.0
    inflight: set[str] = field(default_factory=set)  # sample request ids
    stepping: list | None = None  # an outstanding sample_steps call (on every rank)

    @property
    def pid(self) -> int:
        return self.pids[0] if self.pids else 0

    def __str__(self) -> str:
        ranks = f", {len(self.ranks)} ranks" if len(self.ranks) > 1 else ""
        return f"the {self.role} worker of {self.model!r} (pid {self.pid}{ranks})"


class RayBackend(chat.TextMethods, LossMethods):
    """The Backend over Ray actors (see the module docstring). Thread-safe between the scheduler's
    training thread and its sampling thread (`separate_sampling`)."""

    separate_sampling = True

    def __init__(self, config: EngineConfig, placements: list[Placement], address: str | None = None):
        import ray

        self._ray = ray
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            try:
                ray.init(address=address, log_to_driver=False, configure_logging=False)
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
        self._next_page_sweep = 0.0  # page_out_idle asks the trainers at most once a second
        self._tokenizers: dict[str, Any] = {}  # model -> its tokenizer, fetched once from its trainer
        self._tokenizer_lock = threading.Lock()
        actor = ray.remote(ModelWorker)
        # Each worker process's environment, whoever started Ray: offline.
        env = {"HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
        try:
            for p in placements:
                options = dict(num_cpus=p.num_cpus, num_gpus=p.num_gpus, resources=p.resources or None,
                               max_restarts=-1, max_task_retries=0, runtime_env={"env_vars": env})
                self._names[p.model] = self._names[p.name] = p.name
                self._trainers[p.name] = _Worker([actor.options(**options).remote(config, p.model, p.name, rank,
                                                                                  p.shards)
                                                  for rank in range(p.shards)], p.name, "trainer")
                self._samplers[p.name] = [_Worker([actor.options(**options).remote(config, p.model, p.name)],
                                                  p.name, "sampler") for _ in range(p.samplers)]
            for worker in self._workers():
                self._start(worker)
            for worker in self._workers():
                info, worker.pids, worker.node = self._started(worker)
                if isinstance(info, Raised):
                    raise_failure(info.failure)
                self._info[worker.model] = info
        except BaseException:
            self.close()
            raise

    # ---- workers ----------------------------------------------------------------------------

    def _workers(self) -> list[_Worker]:
        return [*self._trainers.values(), *(w for ws in self._samplers.values() for w in ws)]

    def _start(self, worker: _Worker) -> None:
        """Begin (re)starting: describe each actor; the ranks of a sharded trainer form their group first."""
        worker.stepping = worker.ping = None
        worker.joining = len(worker.ranks) > 1
        worker.restarting = [r.describe.remote() for r in worker.ranks]

    def _started(self, worker: _Worker) -> tuple[ModelInfo | Raised | None, list[int], str]:
        """Wait for a start begun by _start (at startup only: never while serving)."""
        described = self._ray.get(worker.restarting)
        if worker.joining:
            address = self._ray.get(worker.ranks[0].address.remote())
            described = self._ray.get([r.join.remote(address) for r in worker.ranks])
        worker.restarting, worker.joining = None, False
        return described[0][0], [d[1] for d in described], described[0][2]

    def _lose(self, worker: _Worker, error: BaseException) -> WorkerLost:
        """`worker` died (or one rank of it): what it held is gone. Its runs are reported lost; it restarts
        (Ray restarts a dead actor; the surviving ranks of a sharded trainer are restarted with it)."""
        with self._lock:
            if worker.restarting is None:
                if len(worker.ranks) > 1:
                    for rank in worker.ranks:
                        self._ray.kill(rank, no_restart=False)
                self._start(worker)
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
            ready, _ = self._ray.wait(worker.restarting, num_returns=len(worker.restarting), timeout=0)
            if len(ready) < len(worker.restarting):
                return False
            try:
                described = self._ray.get(worker.restarting)
            except self._ray.exceptions.RayError:
                self._start(worker)
                return False
            if worker.joining:  # every rank is back: they form their group and load their shards
                worker.joining = False
                address = self._ray.get(worker.ranks[0].address.remote())
                worker.restarting = [r.join.remote(address) for r in worker.ranks]
                return False
            worker.pids, worker.node = [d[1] for d in described], described[0][2]
            worker.restarting = None
            return True

    def _get(self, worker: _Worker, refs: list) -> Any:
        """Rank 0's result of a call made on every rank: a WhitneyError raised there is raised here, a
        death is WorkerLost. Any rank failing loses a sharded trainer (its process group is broken)."""
        errors = self._ray.exceptions.RayError if len(refs) > 1 else self._ray.exceptions.RayActorError
        try:
            pending, results = list(refs), {}
            while pending:  # one by one: a rank that died must not leave us waiting on its peers
                ready, pending = self._ray.wait(pending, num_returns=1)
                results[ready[0]] = self._ray.get(ready[0])
            result = results[refs[0]]
        except errors as e:
            raise self._lose(worker, e) from None
        if isinstance(result, Raised):
            raise_failure(result.failure)
        return result

    def _submit(self, worker: _Worker, method: str, *args) -> list:
        """The same call on every rank of the worker (SPMD); their refs, rank 0's first."""
        return [getattr(rank, method).remote(*args) for rank in worker.ranks]

    def _call(self, worker: _Worker, method: str, *args) -> Any:
        if not self._usable(worker):
            raise Unavailable(f"{worker} is restarting after a failure; try again shortly", field="base_model")
        return self._get(worker, self._submit(worker, "call", method, *args))

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
        """The process ids of a model's workers: the trainer's ranks, then each replica."""
        return [pid for w in (self._trainers[model], *self._samplers[model]) for pid in w.pids]

    # ---- the Backend ------------------------------------------------------------------------

    @property
    def models(self) -> dict[str, ModelInfo]:
        return dict(self._info)

    def adapter_bytes(self, base_model: str, lora: LoraConfig) -> int:
        return adapter_bytes(self._info[self._model(base_model)].linear_shapes, lora, self.config.max_lora_rank)

    def validate(self, request: ForwardRequest, backward: bool) -> int:
        if request.run_id is None:
            model = self._model(request.base_model)
        else:
            model = self._trainer_of_run(request.run_id).model
        info = self._info[model]
        chunks = [c for d in (request.data if isinstance(request.data, list) else ())
                  for c in (getattr(d, "token_ids", None) if isinstance(getattr(d, "token_ids", None), list) else ())]
        if info.vision and any(not isinstance(c, (int, list)) for c in chunks):
            # image chunks: the model's own processor expands them, in the worker
            return self._call(self._trainers[model], "validate", request, backward)
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
            calls.append((trainer, indices, self._submit(trainer, "call", "run_batch", batch, backward)))
        for trainer, indices, refs in calls:
            try:
                results = self._get(trainer, refs)
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

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | Failure]:
        """One trainer call per step (the in-process backend batches them in one pass)."""
        out: list = []
        for run_id, params in steps:
            try:
                out.append(self.optim_step(run_id, params))
            except (WhitneyError, WorkerLost) as e:
                out.append(Failure.of(e))
        return out

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
        for worker, refs in [(w, self._submit(w, "warm", path)) for w in replicas]:
            try:
                self._get(worker, refs)
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

    def submit_sample(self, request_id: str, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> None:
        worker, weights = self._sampling_worker(weights)
        self._call(worker, "submit_sample", request_id, prompt, params, weights, stream)
        with self._lock:
            worker.inflight.add(request_id)

    def sample_step(self) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        """Keep one decode call outstanding on every worker with requests in flight; wait briefly for one
        to answer; the streaming requests' progress and the requests that ended (those of a worker that
        died: WorkerLost)."""
        with self._lock:
            busy = [w for w in self._workers() if w.inflight]
            for w in busy:
                if w.stepping is None:
                    seconds = SAMPLER_STEP_SECONDS if w.role == "sampler" else 0.0
                    w.stepping = self._submit(w, "sample_steps", seconds)
            pending = {w.stepping[0]: w for w in busy}
        if not pending:
            return []
        ready, _ = self._ray.wait(list(pending), num_returns=1, timeout=SAMPLER_STEP_SECONDS)
        ended: list[tuple[str, SampleResult | Failure]] = []
        for ref in ready:
            worker = pending[ref]
            refs, worker.stepping = worker.stepping, None
            try:
                ended += self._get(worker, refs)
            except WorkerLost as e:
                ended += [(request_id, Failure.of(e)) for request_id in worker.inflight]
            with self._lock:
                worker.inflight -= {r for r, outcome in ended if not isinstance(outcome, SampleProgress)}
        return ended

    # ---- the model's tokenizer, here in the control plane ----------------------------------------------

    def tokenizer(self, base_model: str):
        """The model's own tokenizer, fetched from its trainer once (pickled, so no node needs the model's
        files but the workers); later calls never leave this process."""
        model = self._model(base_model)
        with self._tokenizer_lock:
            if model not in self._tokenizers:
                self._tokenizers[model] = self._call(self._trainers[model], "tokenizer", model)
            return self._tokenizers[model]

    @property
    def sampling(self) -> int:
        """Sampling requests in flight on every worker."""
        with self._lock:
            return sum(len(w.inflight) for w in self._workers())

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
                    worker.ping, worker.pinged_at = self._submit(worker, "describe"), now
                continue
            ready, _ = self._ray.wait(worker.ping, num_returns=len(worker.ping), timeout=0)
            if len(ready) < len(worker.ping):
                continue
            try:
                pids = [d[1] for d in self._ray.get(worker.ping)]
                worker.ping = None
                if pids != worker.pids:
                    self._lose(worker, RuntimeError(f"restarted as pids {pids}"))
            except self._ray.exceptions.RayActorError as e:
                self._lose(worker, e)
        with self._lock:
            lost, self._lost = self._lost, []
        return lost

    def page_out_idle(self) -> int:
        """Every trainer pages out its own idle runs (engine/paging.py); asked at most once a second."""
        if self.config.page_idle_seconds is None or time.monotonic() < self._next_page_sweep:
            return 0
        self._next_page_sweep = time.monotonic() + 1.0
        return sum(self._each_trainer("page_out_idle"))

    def residency(self) -> dict:
        """Runs in memory and paged out, page-outs and page-ins, their histograms' buckets: summed over the
        trainers (replicas hold none)."""
        answers = self._each_trainer("residency") or [{"in_memory": 0, "paged_out": 0}]
        return {key: ({bucket: sum(a[key][bucket] for a in answers) for bucket in value} if isinstance(value, dict)
                      else sum(a[key] for a in answers)) for key, value in answers[0].items()}

    def _each_trainer(self, method: str) -> list:
        """The method's answer from each trainer; one lost or restarting has no runs to count."""
        answers = []
        for worker in list(self._trainers.values()):
            try:
                answers.append(self._call(worker, method))
            except (WorkerLost, Unavailable):
                pass
        return answers

    def close(self) -> None:
        """Stop the workers (and the local Ray instance this backend started)."""
        for actor in (a for w in self._workers() for a in w.ranks):
            try:
                self._ray.kill(actor, no_restart=True)
            except Exception:
                pass
        if self._owns_ray and self._ray.is_initialized():
            self._ray.shutdown()
