"""RayBackend: the Backend over Ray actors, so base models live on a cluster's nodes and devices.

    control plane (one process)                  Ray cluster
    HTTP -> store -> Scheduler -> RayBackend ── ModelWorker "trainer" of model A: its runs' adapters,
                                            │   gradients and optimizer state; forward(_backward) etc.
                                            ├── ModelWorker "sampler" x K of model A: sample and
                                            │   compute_logprobs on frozen weights read from files
                                            └── ModelWorker "trainer" of model B (another node) ...

This module is the translation: each protocol call becomes a typed call (calls.py) to the worker that holds
what it names. Every worker is an `InProcessBackend` inside a Ray actor (actor.py), so its numbers are the
in-process engine's, and what crosses the wire is the protocol's plain data. The rest lives beside it:
- supervisor.py: the workers, their restarts and heartbeats, and the runs on each trainer (a trainer that dies
  fails its calls with `WorkerLost` and its runs are reported by `take_lost_runs`; a call to a worker that is
  restarting is refused at once with `Unavailable`);
- workers.py: a worker, one actor or the ranks of a sharded trainer (every call to every rank, rank 0 answers);
- sampling.py: the sampler versions every replica has loaded, the choice of replica, requests in flight.

Requests are validated here, from each model's `ModelInfo`, with the engine's own check (no round trip); a
forward batch or a set of optimizer steps is split by base model and sent to each model's trainer at once.
Ray is an optional dependency (`pip install whitney[ray]`), imported only when this backend starts.
"""

from __future__ import annotations

import threading
import time
from functools import reduce
from typing import Any, Callable

from whitney.backends.in_process import adapter_bytes
from whitney.backends.ray.calls import (
    Adopt, Call, ComputeLogprobs, CountResidency, CreateRun, DeleteRun, ImageTokens, LoadState, OptimSteps,
    PageOutIdle, RunBatch, Save, SettleGradients, TakeLostRuns, TokenizerFiles, Validate)
from whitney.backends.ray.placement import Placement
from whitney.backends.ray.sampling import Sampling
from whitney.backends.ray.supervisor import Supervisor
from whitney.backends.ray.workers import Role, Worker
from whitney.engine.families import chat
from whitney.engine.losses.builtin import LossMethods
from whitney.engine.training.requests import check_request
from whitney.errors import NotFound, Unavailable, WhitneyError
from whitney.protocol.backend import Failure, ModelInfo, PackageKind, Residency, Weights, WorkerLost
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import AdamParams, Checked, ForwardRequest, ForwardResult, LoraConfig

__all__ = ["Placement", "RayBackend"]


class RayBackend(chat.TextMethods, LossMethods):
    """The ServedBackend over Ray actors (see the module docstring). Thread-safe between the scheduler's
    training thread and its sampling thread (`separate_sampling`)."""

    separate_sampling = True

    def __init__(self, config: EngineConfig, placements: list[Placement], address: str | None = None,
                 service: str | None = None):
        self.config = config
        # Every worker started (or, for a highly available `service`, found where another member started it),
        # each model loaded.
        self.supervisor = Supervisor(config, placements, address, service)
        self._sampling = Sampling(self.supervisor)
        self._next_page_sweep = 0.0  # page_out_idle asks the trainers at most once a second
        self._next_lost_check = 0.0  # take_lost_runs too, for runs whose paged-out state was lost
        self._tokenizers: dict[str, Any] = {}  # model -> its tokenizer, fetched once from its trainer
        self._tokenizer_lock = threading.Lock()

    def _on_run(self, run_id: str, call: Call):
        return self.supervisor.call(self.supervisor.trainer_of_run(run_id), call)

    def _per_trainer(self, items: list, trainer_of: Callable[[Any], Worker], call: Callable[[list], Call[list]]
                     ) -> list:
        """Each trainer's share of `items` in one call to it, every trainer at once; the answers in item order
        (a Failure for an item whose run or model is unknown or lost, or whose trainer restarts)."""
        out: list = [None] * len(items)
        shares: dict[str, tuple[Worker, list[int]]] = {}
        for i, item in enumerate(items):
            try:
                trainer = trainer_of(item)
            except (WhitneyError, WorkerLost) as e:
                out[i] = Failure.of(e)
                continue
            shares.setdefault(trainer.model, (trainer, []))[1].append(i)
        calls = []
        for trainer, indices in shares.values():
            if not self.supervisor.usable(trainer):
                for i in indices:
                    out[i] = Failure.of(Unavailable(f"{trainer} is restarting after a failure; try again shortly"))
                continue
            calls.append((trainer, indices, trainer.submit(call([items[i] for i in indices]))))
        for trainer, indices, refs in calls:
            try:
                answers = self.supervisor.result(trainer, refs)
            except WorkerLost as e:
                answers = [Failure.of(e)] * len(indices)
            for i, answer in zip(indices, answers, strict=True):
                out[i] = answer
        return out

    # ---- the Backend ------------------------------------------------------------------------

    @property
    def models(self) -> dict[str, ModelInfo]:
        return dict(self.supervisor.models)

    def adapter_bytes(self, base_model: str, lora: LoraConfig) -> int:
        info = self.supervisor.models[self.supervisor.model(base_model)]
        return adapter_bytes(info.linear_shapes, lora, self.config.max_lora_rank)

    def validate(self, request: ForwardRequest, backward: bool) -> Checked:
        """On the request's base model when it names one (a run this process does not hold: an API process of a
        highly available service), else its run's."""
        trainer = self.supervisor.trainer(None if request.base_model else request.run_id, request.base_model)
        info = self.supervisor.models[trainer.model]
        if info.vision and _has_images(request):  # the model's own processor expands them: in the worker
            return self.supervisor.call(trainer, Validate(request, backward))
        return check_request(request, backward, info.vocab_size, info.max_context).checked()

    def image_tokens(self, base_model: str, chunks: list) -> list[int]:
        """Expanded by the model's trainer (its processor); a sampler replica decodes the image again."""
        trainer = self.supervisor.trainer(None, base_model)
        return self.supervisor.call(trainer, ImageTokens(trainer.model, chunks))

    def create_run(self, run_id: str, base_model: str, lora: LoraConfig, resume_path: str | None = None,
                   resume_with_optimizer: bool = False) -> None:
        trainer = self.supervisor.trainers[self.supervisor.model(base_model)]
        self.supervisor.call(trainer, CreateRun(run_id, trainer.model, lora, resume_path, resume_with_optimizer))
        self.supervisor.add_run(run_id, trainer.model)

    def delete_run(self, run_id: str) -> None:
        model = self.supervisor.drop_run(run_id)
        self._sampling.forget(run_id)
        if model is not None:
            try:
                self.supervisor.call(self.supervisor.trainers[model], DeleteRun(run_id))
            except (WorkerLost, Unavailable):
                pass  # gone with its worker

    def run_batch(self, requests: list[ForwardRequest], backward: bool) -> list[ForwardResult | Failure]:
        """Each base model's requests to its trainer, all models at once; results in request order."""
        return self._per_trainer(requests, lambda r: self.supervisor.trainer(r.run_id, r.base_model),
                                 lambda share: RunBatch(share, backward))

    def settle_gradients(self, run_id: str, stage: str, keep: bool) -> None:
        try:
            self._on_run(run_id, SettleGradients(run_id, stage, keep))
        except (WorkerLost, Unavailable, NotFound):
            if keep:
                raise  # dropping is done already: nothing staged survives a lost worker

    def optim_steps(self, steps: list[tuple[str, AdamParams]]) -> list[dict[str, float] | Failure]:
        """Each trainer's steps in one call to it (one pass there, as in-process), every trainer at once."""
        return self._per_trainer(steps, lambda step: self.supervisor.trainer_of_run(step[0]), OptimSteps)

    def save(self, run_id: str, kind: PackageKind, path: str, include_optimizer: bool = True) -> int | None:
        """The trainer writes the package; a sampler version is then loaded by every replica before this returns."""
        trainer = self.supervisor.trainer_of_run(run_id)
        version = self.supervisor.call(trainer, Save(run_id, kind, path, include_optimizer))
        if kind == PackageKind.SAMPLER:
            self._sampling.publish(trainer.model, run_id, version, path)
        return version

    def load_state(self, run_id: str, path: str, with_optimizer: bool = False) -> None:
        self._on_run(run_id, LoadState(run_id, path, with_optimizer))

    def compute_logprobs(self, sequences: list[list[int]], weights: Weights) -> list[list[float | None]]:
        worker, weights = self._sampling.worker(weights)
        return self.supervisor.call(worker, ComputeLogprobs(sequences, weights))

    def submit_sample(self, request_id: str, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> None:
        self._sampling.submit(request_id, prompt, params, weights, stream)

    def sample_step(self) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        return self._sampling.step()

    def cancel_sample(self, request_id: str) -> None:
        """To the worker the request went to (sampling.py `Sampling.cancel`)."""
        self._sampling.cancel(request_id)

    # ---- Tokenizers: the model's own, here in the control plane ------------------------------

    def tokenizer(self, base_model: str):
        """The model's own tokenizer, made here once from the files its trainer sends (plain data: no live object
        crosses, and no node needs the model's files but the workers); later calls never leave this process."""
        model = self.supervisor.model(base_model)
        with self._tokenizer_lock:
            if model not in self._tokenizers:
                files = self.supervisor.call(self.supervisor.trainers[model], TokenizerFiles(model))
                self._tokenizers[model] = chat.tokenizer_from_files(files)
            return self._tokenizers[model]

    # ---- Housekeeping -------------------------------------------------------------------------

    def take_lost_runs(self) -> list[str]:
        """Runs lost with a trainer that died (the supervisor's), and runs a trainer lost itself: their
        paged-out state could not be read back (engine/memory/paging.py; asked at most once a second, and only
        when runs may be paged out)."""
        self._sampling.stop_idle()  # elastic replicas idle long enough (asked here: the scheduler asks often)
        lost = self.supervisor.take_lost_runs()
        paging = self.config.page_idle_seconds is not None or self.config.max_resident_runs is not None
        if paging and time.monotonic() >= self._next_lost_check:
            self._next_lost_check = time.monotonic() + 1.0
            lost += [run_id for runs in self.supervisor.each_trainer(TakeLostRuns()) for run_id in runs]
        return lost

    def adopt(self) -> list[str]:
        """A new scheduling leader takes the workers over (service/cluster): every worker's samples in flight
        cancelled, and the runs each trainer holds, recorded as its own; those runs."""
        held = []
        for worker in self.supervisor.workers():
            runs = self.supervisor.call(worker, Adopt())
            for run_id in runs if worker.role == Role.TRAINER else ():
                self.supervisor.add_run(run_id, worker.model)
                held.append(run_id)
        return held

    def page_out_idle(self) -> int:
        """Every trainer pages out its own idle runs (engine/memory/paging.py); asked at most once a second."""
        if self.config.page_idle_seconds is None or time.monotonic() < self._next_page_sweep:
            return 0
        self._next_page_sweep = time.monotonic() + 1.0
        return sum(self.supervisor.each_trainer(PageOutIdle()))

    def residency(self) -> Residency:
        """Summed over the trainers (replicas hold no runs)."""
        return reduce(Residency.plus, self.supervisor.each_trainer(CountResidency()), Residency())

    @property
    def sampling_in_flight(self) -> int:
        return self._sampling.in_flight

    def close(self) -> None:
        """Stop the workers (and the local Ray instance this backend started)."""
        self.supervisor.close()


def _has_images(request: ForwardRequest) -> bool:
    """Whether a request (not validated yet) holds chunks other than token ids: images."""
    data = request.data if isinstance(request.data, list) else []
    return any(not isinstance(c, (int, list)) for d in data if isinstance(getattr(d, "token_ids", None), list)
               for c in d.token_ids)
