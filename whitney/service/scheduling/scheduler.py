"""The scheduler: what routes hand their operations to, and the worker threads that drive the backend.

Routes record an operation in the store, then hand its typed job here. The worker wakes on an event (never a
sleep loop) and serves, turn by turn, the parts each module here owns:
  run_queues.py  each run's operations in seq_id order; a finishing run drained, a cancelled one emptied
  training.py    one engine call of ready forward(_backward) work, fairly shared, then every other ready
                 training operation (all optim_steps in one backend call)
  sampling.py    sampling steps for as long as the last training iteration took (at least one)
  scoring.py     compute_logprobs, a chunk per turn
  reaping.py     runs lost with their worker, idle sessions, expired checkpoints
  ends.py        each end stored (a turn's in one transaction), then long-polls and stream listeners woken
  lanes.py       a worker thread's calls and loop
Training and sampling share one thread, so neither starves the other; a backend whose sampling runs apart from
training (`separate_sampling`: the Ray backend's sampler workers) gets a second thread for sampling and scoring,
so neither waits for the other. One lock (`_lock`) guards the queues, the lanes' calls and the waiters.
"""

from __future__ import annotations

import concurrent.futures
import threading
from pathlib import Path
from typing import Any, Callable

from whitney.protocol.backend import ServedBackend, Weights
from whitney.protocol.sampling import SamplingParams
from whitney.protocol.training import LoraConfig
from whitney.service.scheduling.ends import Ends
from whitney.service.scheduling.jobs import Job
from whitney.service.scheduling.lanes import Lane, Worker
from whitney.service.scheduling.reaping import Reaper
from whitney.service.scheduling.run_queues import RunQueues
from whitney.service.scheduling.sampling import Sampling
from whitney.service.scheduling.scoring import ScoringTurns
from whitney.service.scheduling.streams import SampleStream
from whitney.service.scheduling.training import Training
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationStatus, RunStatus
from whitney.service.store.records import OperationRecord


class Scheduler:
    def __init__(self, backend: ServedBackend, store: Store, data_dir: Path, max_batch_tokens: int = 8192,
                 session_timeout: float = 600.0, recent_seconds: float = 2.0, expiry_interval: float = 5.0):
        self.backend = backend
        self.store = store
        self.data_dir = Path(data_dir)
        self.max_batch_tokens = max_batch_tokens
        self._lock = threading.RLock()  # waiters are woken while it is held
        self._stop = False
        self.ends = Ends(store, self._lock)
        self.queues = RunQueues(backend, store, self.ends, self._lock)
        self.training = Training(backend, store, self.data_dir, self.queues, self.ends, max_batch_tokens,
                                 recent_seconds)
        self._training_lane = Lane(Worker.TRAINING, self._lock)
        # Sampling and scoring: on the training thread, or on their own when the backend runs them apart.
        shared = not backend.separate_sampling
        self._sampling_lane = self._training_lane if shared else Lane(Worker.SAMPLING, self._lock)
        self.sampling = Sampling(backend, store, self.ends, self._sampling_lane, self._lock,
                                 budget=(lambda: self.training.seconds) if shared else (lambda: 0.0))
        self.scoring = ScoringTurns(backend, store, self.ends, self._lock, max_batch_tokens)
        self.reaper = Reaper(backend, store, self.queues, self.cancel_run, session_timeout, expiry_interval)
        self._threads = [threading.Thread(target=self._loop, name=self._training_lane.name, daemon=True)]
        if not shared:
            self._threads.append(threading.Thread(target=self._sampling_loop, name=self._sampling_lane.name,
                                                  daemon=True))

    # ---- from any thread ----------------------------------------------------------------

    def start(self) -> None:
        """Run the worker loop on its own thread (tests, the demo's in-process server)."""
        for thread in self._threads:
            thread.start()

    def run(self) -> None:
        """Run the worker loop on the calling thread until stop(). `whitney serve` runs it on the main
        thread: torch's OpenMP kernels launched from any other thread pay more per call (libgomp keeps no
        spinning team for them), which slows decoding."""
        for thread in self._threads[1:]:
            thread.start()
        self._loop()

    def stop(self) -> None:
        self._stop = True
        for lane in {id(self._training_lane): self._training_lane, id(self._sampling_lane): self._sampling_lane
                     }.values():
            lane.wake.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=30)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn() on the training thread (the backend's owner); the future carries its result."""
        return self._training_lane.call(fn)

    def submit(self, operation: OperationRecord, job: Job) -> None:
        """Queue a training operation already recorded in the store."""
        self.queues.submit(operation, job)
        self._training_lane.wake.set()

    def submit_sample(self, operation: OperationRecord, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False, listener: SampleStream | None = None) -> SampleStream | None:
        """Queue a sampling operation; the backend knows it by the operation's id. With `stream`, the
        tokens reach the returned listener (`listener`, or a new one) as they are chosen (its end: the operation is
        terminal)."""
        listener = self.ends.listen(operation.id, listener) if stream else None
        self._sampling_lane.call(lambda: self.sampling.start(operation, prompt, params, weights, stream))
        return listener

    def drop_stream(self, op_id: str) -> None:
        """Nobody listens any more: the stream's reports are dropped (`cancel_sample` stops the sample itself)."""
        self.ends.drop_stream(op_id)

    def cancel_sample(self, op_id: str, reason: str = "the sample was cancelled") -> concurrent.futures.Future:
        """Stop a sampling operation (its client went away, or cancelled it): before the backend's next sampling
        step its rows leave the batch and its cache is freed, and it ends cancelled with `reason`. From any
        thread, at once (the event loop's too: the work runs on the sampling lane); the future says whether it
        was still in flight (one that ended first is left as it is)."""
        return self._sampling_lane.call(lambda: self.sampling.cancel(op_id, reason))

    def submit_logprobs(self, operation: OperationRecord, sequences: list[list[int]], weights: Weights) -> None:
        """Score sequences on the named weights (not in any run's seq_id order), a chunk per iteration."""
        self.scoring.submit(operation, sequences, weights)
        self._sampling_lane.wake.set()

    def open_run(self, run_id: str, base_model: str, lora: dict, resume_path: str | None = None,
                 resume_with_optimizer: bool = False) -> concurrent.futures.Future:
        """Create a run's adapter in the backend (and load the checkpoint it resumes from), before the run is
        recorded: the backend validates the LoRA config against the model."""
        def create() -> None:
            self.backend.create_run(run_id, base_model, LoraConfig.from_dict(lora), resume_path, resume_with_optimizer)
            self.queues.open(run_id)
        return self.call(create)

    def finish_run(self, run_id: str) -> concurrent.futures.Future:
        """Run what is queued, then mark the run finished (at once when nothing is queued)."""
        return self.call(lambda: self.queues.finish(run_id))

    def cancel_run(self, run_id: str, reason: str = "run cancelled") -> None:
        """Cancel queued operations and one part-way through its micro-batches (a single engine call
        that is running ends); then the run is cancelled."""
        self.queues.end(run_id, OperationStatus.CANCELLED, {"code": "cancelled", "message": reason})

        def drop() -> None:
            self.backend.delete_run(run_id)
            self.store.set_run_status(run_id, RunStatus.CANCELLED)
        self.call(drop)

    async def wait(self, op_id: str, timeout: float) -> None:
        """Return when the operation may have become terminal, or after `timeout` seconds."""
        await self.ends.wait(op_id, timeout)

    # ---- the worker threads -------------------------------------------------------------

    def _loop(self) -> None:
        """The training thread: calls, lost runs, one training iteration, (sampling and scoring when they
        share this thread), expiry, and idle runs paged out (the backend's clock check between calls)."""
        steps = [self.reaper.interrupt_lost_runs, self.training.step]
        if self._sampling_lane is self._training_lane:
            steps += [self.sampling.step, self.scoring.step]
        self._training_lane.serve([*steps, self.reaper.expire, self.backend.page_out_idle], lambda: self._stop)

    def _sampling_loop(self) -> None:
        """The sampling thread of a backend with `separate_sampling`: its calls, sampling steps and scoring."""
        self._sampling_lane.serve([self.sampling.step, self.scoring.step], lambda: self._stop)
