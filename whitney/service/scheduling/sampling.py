"""The sampling lane: samples submitted to the backend (which knows each by its operation's id), its sampling
steps run, each request that ended in one answered, and a streaming request's new tokens handed to its listener
as each step reports them (its end follows the stored result). A sample whose client went away, or that was
cancelled, is dropped between two steps (`cancel`): it ends cancelled and the backend frees what it held.

On the training thread, sampling steps run until they took as long as the last training iteration (at least
one): training and sampling get equal time while both have work, and a sample submitted meanwhile joins at
the next step. A backend whose sampling runs apart from training (`separate_sampling`) gets a thread of its own.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from whitney.protocol.backend import Backend, Failure, Weights
from whitney.protocol.sampling import SampleProgress, SamplingParams
from whitney.service.scheduling.ends import End, Ends
from whitney.service.scheduling.lanes import Lane
from whitney.service.scheduling.results import sample_result
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationStatus
from whitney.service.store.records import OperationRecord


class Sampling:
    """The samples in flight, driven from `lane`; `budget()`: the seconds of sampling steps per turn after the
    first (the last training iteration's time on a shared thread, none on a thread of its own)."""

    def __init__(self, backend: Backend, store: Store, ends: Ends, lane: Lane, lock: threading.RLock,
                 budget: Callable[[], float]):
        self.backend = backend
        self.store = store
        self.ends = ends
        self.lane = lane
        self.budget = budget
        self._lock = lock
        self._samples: dict[str, OperationRecord] = {}  # operation id (the backend's request id) -> operation

    def start(self, operation: OperationRecord, prompt: list[int], params: SamplingParams, weights: Weights,
              stream: bool) -> None:
        """Hand the sample to the backend (on the lane's thread); one it refuses ends at once."""
        try:
            self.backend.submit_sample(operation.id, prompt, params, weights, stream=stream)
        except BaseException as e:
            self.ends.finish_all([(operation, None, e)])
            return
        self.store.set_operation(operation.id, OperationStatus.RUNNING)
        self._samples[operation.id] = operation

    def cancel(self, op_id: str, reason: str) -> bool:
        """Stop a sample in flight (on the lane's thread, so between two steps): the backend drops its rows and
        frees its cache before the next step, and the operation ends cancelled, its stream's listener told.
        Whether it was in flight (one already ended, or never started, is left as it is)."""
        operation = self._samples.pop(op_id, None)
        if operation is None:
            return False
        try:
            self.backend.cancel_sample(op_id)
        finally:  # ended either way: a backend that fails to drop it never reports it again either
            self.store.set_operation(op_id, OperationStatus.CANCELLED, error={"code": "cancelled", "message": reason})
            self.ends.notify(op_id)
            with self._lock:
                listener = self.ends.streams.pop(op_id, None)
            if listener is not None:
                listener.end()
        return True

    def step(self) -> bool:
        """Sampling steps of the backend until they took `budget()` seconds (at least one), the lane's calls
        (new samples) run between them; each request that ended in one is answered."""
        if not self._samples:
            return False
        budget = self.budget()
        start = time.monotonic()
        while True:
            self._sample_step()
            if not self._samples or time.monotonic() - start >= budget:
                return True
            self.lane.run_calls()

    def _sample_step(self) -> None:
        """One sampling step of the backend; the requests that ended in it are answered together."""
        ends: list[End] = []
        for request_id, outcome in self.backend.sample_step():
            if isinstance(outcome, SampleProgress):  # a streaming request's new tokens: to its listener
                listener = self.ends.listener(request_id)
                if listener is not None:
                    listener.put(outcome)
                continue
            op = self._samples.pop(request_id, None)
            if op is None:
                continue
            if isinstance(outcome, Failure):  # this request alone failed (and left its batch); the others go on
                ends.append((op, None, outcome))
            else:
                ends.append((op, sample_result(outcome), None))
        self.ends.finish_all(ends)
