"""compute_logprobs requests, in no run's seq_id order: each scored a chunk (at most max_batch_tokens tokens)
per worker iteration, the requests taking turns so that a long one does not hold up a short one."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

from whitney.protocol.backend import Backend, Failure, Weights
from whitney.service.api.images import known_length
from whitney.service.scheduling.ends import Ends
from whitney.service.scheduling.limits import plan_micro_batches
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationStatus
from whitney.service.store.records import OperationRecord


@dataclass
class Scoring:
    """A compute_logprobs request, scored a chunk of sequences per worker iteration."""

    operation: OperationRecord
    sequences: list[list[int]]
    weights: Weights
    done: int = 0
    logprobs: list = field(default_factory=list)

    def score_chunk(self, backend: Backend, max_batch_tokens: int) -> Failure | None:
        """Score the next chunk of sequences (at most max_batch_tokens tokens); its Failure (datum_index
        within the whole request), or None."""
        lengths = [known_length(s) for s in self.sequences[self.done:]]  # positions, an image as its expected_tokens
        (count,), _ = plan_micro_batches([lengths], max_batch_tokens)
        try:
            self.logprobs += backend.compute_logprobs(self.sequences[self.done:self.done + count], self.weights)
        except BaseException as e:
            error = Failure.of(e)
            return error if error.datum_index is None else replace(error, datum_index=error.datum_index + self.done)
        self.done += count
        return None


class ScoringTurns:
    """The compute_logprobs requests waiting for their next chunk, in turn."""

    def __init__(self, backend: Backend, store: Store, ends: Ends, lock: threading.RLock, max_batch_tokens: int):
        self.backend = backend
        self.store = store
        self.ends = ends
        self.max_batch_tokens = max_batch_tokens
        self._lock = lock
        self._turns: list[Scoring] = []

    def submit(self, operation: OperationRecord, sequences: list[list[int]], weights: Weights) -> None:
        with self._lock:
            self._turns.append(Scoring(operation, sequences, weights))

    def step(self) -> bool:
        """Score the next chunk of the request whose turn it is; it ends when its last chunk is scored."""
        with self._lock:
            if not self._turns:
                return False
            job = self._turns.pop(0)
        if job.done == 0:
            self.store.set_operation(job.operation.id, OperationStatus.RUNNING)
        error = job.score_chunk(self.backend, self.max_batch_tokens)
        if error is not None:
            self.ends.finish_all([(job.operation, None, error)])
        elif job.done == len(job.sequences):
            self.ends.finish_all([(job.operation, {"logprobs": job.logprobs}, None)])
        else:
            with self._lock:
                self._turns.append(job)
        return True
