"""Sampling and scoring on the Ray backend: which worker takes a request, which weights it names, and the
requests in flight on each worker.

Sampler replicas (`Placement.samplers` per model) hold no runs: a run's sampler version N is the state file the
trainer writes when saved (`PackageKind.SAMPLER`) to a shared directory, and every replica loads it (checksums
verified) before the save returns (`publish`), so any sample on N finds it everywhere and never sees newer trainer
weights; a replica that restarts loads versions again on first use. A request goes to the least busy usable
replica of its model, or to the trainer when the model has none.
"""

from __future__ import annotations

import time
from dataclasses import replace

from whitney.backends.ray.calls import CancelSample, SampleSteps, SubmitSample, Warm
from whitney.backends.ray.supervisor import Supervisor
from whitney.backends.ray.workers import Role, Worker
from whitney.engine.training.checkpoint import read_manifest
from whitney.errors import NotFound, Unavailable
from whitney.protocol.backend import Failure, SamplerReplicas, Weights, WorkerLost
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams

SAMPLER_STEP_SECONDS = 0.05  # a replica decodes for this long per call (one step: the trainer, which trains too)


class Sampling:
    """The runs' sampler versions (their files, by run and version) and the sampling requests in flight."""

    def __init__(self, supervisor: Supervisor):
        self.supervisor = supervisor
        self._lock = supervisor.lock
        self._versions: dict[tuple[str, int], str] = {}  # (run, version) -> its state file directory

    def publish(self, model: str, run_id: str, version: int, path: str) -> None:
        """Version `version` of the run, just written to `path`: loaded by every usable replica of the model."""
        replicas = [w for w in self.supervisor.samplers[model] if self.supervisor.usable(w)]
        for worker, refs in [(w, w.submit(Warm(path))) for w in replicas]:
            try:
                self.supervisor.result(worker, refs)
            except WorkerLost:
                pass  # it loads the version from the file on first use once restarted
        with self._lock:
            self._versions[(run_id, version)] = path

    def forget(self, run_id: str) -> None:
        with self._lock:
            for key in [k for k in self._versions if k[0] == run_id]:
                del self._versions[key]

    def worker(self, weights: Weights) -> tuple[Worker, Weights]:
        """The least busy usable replica of the weights' model, and the weights as it names them (a run's
        version by its file); the trainer when the model has no replicas, or (elastic) none usable yet: Whitney's
        sampler either way, the same numbers."""
        if weights.run_id is not None:
            model = self.supervisor.trainer_of_run(weights.run_id).model
        elif weights.checkpoint_path is not None:
            model = self.supervisor.model(read_manifest(weights.checkpoint_path)["base_model"])
        else:
            model = self.supervisor.model(weights.base_model)
            weights = replace(weights, base_model=model)
        replicas = self.supervisor.samplers[model]
        candidates = [w for w in replicas if self.supervisor.usable(w)]
        placement = self.supervisor.placements[model]
        elastic = placement.max_samplers is not None and placement.max_samplers > placement.samplers
        if elastic:
            self._scale_up(model, replicas, candidates)
        if not candidates and (elastic or not replicas):
            candidates = [w for w in [self.supervisor.trainers[model]] if self.supervisor.usable(w)]
        if not candidates:
            raise Unavailable(f"every sampling worker of {model!r} is restarting after a failure; try again shortly",
                              field="base_model")
        worker = min(candidates, key=lambda w: len(w.inflight))
        with self._lock:
            worker.idle_since = time.monotonic()  # not stopped as idle before its sample is in flight (stop_idle)
        if worker.role == Role.SAMPLER and weights.run_id is not None:
            with self._lock:
                path = self._versions.get((weights.run_id, weights.version))
            if path is None:
                raise NotFound(f"run {weights.run_id!r} has no sampler version {weights.version}", field="version")
            weights = Weights(checkpoint_path=path)
        return worker, weights

    def _scale_up(self, model: str, replicas: list[Worker], usable: list[Worker]) -> None:
        """Elastic: one more replica when the model has none, or every usable one has SamplerReplicas.BUSY samples
        in flight (and none is starting), up to its maximum."""
        starting = len(replicas) > len(usable)
        if len(replicas) < self.supervisor.placements[model].max_samplers and not starting and (
                not usable or all(len(w.inflight) >= SamplerReplicas.BUSY for w in usable)):
            self.supervisor.add_sampler(model)

    def stop_idle(self) -> None:
        """Elastic: stop each replica idle for its model's sampler_idle_seconds, down to the model's minimum."""
        now = time.monotonic()
        for model, replicas in self.supervisor.samplers.items():
            placement = self.supervisor.placements[model]
            with self._lock:  # a replica chosen for a sample meanwhile counts as busy since (worker())
                for worker in list(replicas):
                    if worker.inflight or worker.stepping is not None or worker.restarting is not None:
                        worker.idle_since = now
                    elif len(replicas) > placement.samplers and now - worker.idle_since >= \
                            placement.sampler_idle_seconds:
                        self.supervisor.remove_sampler(worker)

    def submit(self, request_id: str, prompt: list, params: SamplingParams, weights: Weights, stream: bool) -> None:
        worker, weights = self.worker(weights)
        generation = worker.generation
        self.supervisor.call(worker, SubmitSample(request_id, prompt, params, weights, stream))
        with self._lock:
            worker.inflight[request_id] = generation

    def cancel(self, request_id: str) -> None:
        """Stop a request in flight on the worker that holds it: the cancel is sent without waiting (Ray runs it
        after the steps sent before it, so before the next); whatever an outstanding step still reports of it is
        dropped by the caller, which no longer knows it."""
        with self._lock:
            worker = next((w for w in self.supervisor.workers() if w.inflight.pop(request_id, None) is not None),
                          None)
        if worker is not None and self.supervisor.usable(worker):
            worker.submit(CancelSample(request_id))

    def step(self) -> list[tuple[str, SampleResult | Failure | SampleProgress]]:
        """Keep one decode call outstanding on every worker with requests in flight; wait briefly for one
        to answer; the streaming requests' progress and the requests that ended (those of a worker that
        died: WorkerLost)."""
        ended: list[tuple[str, SampleResult | Failure | SampleProgress]] = []
        with self._lock:
            for w in self.supervisor.workers():
                stale = [r for r, g in w.inflight.items() if g != w.generation]
                if stale:  # sent to a process whose death a call on another thread noticed: lost with it
                    lost = Failure.of(WorkerLost(f"{w} died; Ray restarts it and reloads the base model"))
                    ended += [(r, lost) for r in stale]
                    for r in stale:
                        del w.inflight[r]
            busy = [w for w in self.supervisor.workers() if w.inflight]
            for w in busy:
                if w.stepping is None:
                    w.stepping = w.submit(SampleSteps(SAMPLER_STEP_SECONDS if w.role == Role.SAMPLER else 0.0))
            pending = {w.stepping[0]: (w, w.stepping, w.generation) for w in busy}
        if not pending:
            return ended
        ready, _ = self.supervisor.ray.wait(list(pending), num_returns=1, timeout=SAMPLER_STEP_SECONDS)
        for ref in ready:
            worker, refs, generation = pending[ref]
            with self._lock:
                if worker.stepping is refs:
                    worker.stepping = None
                if generation != worker.generation:
                    continue  # the process that died answered: its requests are failed as stale
            try:
                answers = self.supervisor.result(worker, refs)
            except WorkerLost as e:
                answers = [(r, Failure.of(e)) for r, g in list(worker.inflight.items()) if g == generation]
            with self._lock:
                for request_id, outcome in answers:
                    if not isinstance(outcome, SampleProgress):
                        worker.inflight.pop(request_id, None)
            ended += answers
        return ended

    @property
    def in_flight(self) -> int:
        """Sampling requests in flight on every worker."""
        with self._lock:
            return sum(len(w.inflight) for w in self.supervisor.workers())
