"""Each run's operations in seq_id order: parked by seq_id as they arrive (in any order, retries ignored), the
next one handed out when it is there, a finishing run drained, a cancelled or lost run's waiting ones ended.

A run's queue lives from `open` (its adapter created) to its end: finished when drained (`finish`), cancelled,
or interrupted with its lost worker (`end`). The lock is the scheduler's: a test holds it to queue several
operations at once, unseen by the worker until it lets go.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from whitney.protocol.backend import Backend
from whitney.protocol.training import ForwardResult
from whitney.service.scheduling.ends import Ends
from whitney.service.scheduling.jobs import Job
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationStatus, RunStatus
from whitney.service.store.records import OperationRecord

@dataclass
class Progress:
    """A forward/forward_backward operation part-way through its micro-batches."""

    done: int = 0  # datums already run
    parts: list[ForwardResult] = field(default_factory=list)
    staged: bool = False  # runs in more than one micro-batch: its gradient is staged under its id


@dataclass
class RunQueue:
    next_seq: int = 0
    pending: dict[int, tuple[OperationRecord, Job]] = field(default_factory=dict)  # seq_id -> (operation, job)
    finishing: bool = False
    progress: Progress | None = None  # of the operation at next_seq, once its first micro-batch ran
    served: int = 0  # the engine call that last ran its work (fairness: the least recently served first)
    credit: int = 0  # tokens' worth its operation at next_seq earned waiting and has not spent (`plan_micro_batches`)
    # When it last had a forward/forward_backward ready (engine call count, monotonic time) and its tokens:
    # for a while after, its share of each call is reserved (`plan_micro_batches`).
    active_call: int = -(10**9)
    active_at: float = -1e18
    active_tokens: int = 0

    def part_way(self) -> OperationRecord | None:
        """The operation at next_seq once one of its micro-batches ran (it is RUNNING in the store), else None."""
        if self.progress is not None and self.next_seq in self.pending:
            return self.pending[self.next_seq][0]
        return None


class RunQueues:
    """The open runs' queues, by run id."""

    def __init__(self, backend: Backend, store: Store, ends: Ends, lock: threading.RLock):
        self.backend = backend
        self.store = store
        self.ends = ends
        self._lock = lock
        self._runs: dict[str, RunQueue] = {}

    def open(self, run_id: str, next_seq: int = 0) -> None:
        """A new run's queue (or, adopted by a new scheduling leader, one whose seq_ids before `next_seq` ended)."""
        with self._lock:
            self._runs.setdefault(run_id, RunQueue(next_seq=next_seq))

    def submit(self, operation: OperationRecord, job: Job) -> None:
        """Park a training operation under its seq_id (a retry of one already known is ignored)."""
        with self._lock:
            queue = self._runs.setdefault(operation.run_id, RunQueue())
            if operation.seq_id < queue.next_seq or operation.seq_id in queue.pending:
                return
            queue.pending[operation.seq_id] = (operation, job)

    def finish(self, run_id: str) -> None:
        """Run what is queued, then mark the run finished (at once when nothing is queued)."""
        with self._lock:
            queue = self._runs.setdefault(run_id, RunQueue())
            queue.finishing = True
            if queue.next_seq not in queue.pending:
                self._finalize(run_id, queue)

    def ready(self) -> list[tuple[RunQueue, OperationRecord, Job]]:
        """For each run, its next operation if it has arrived; finish runs that are drained."""
        ready = []
        with self._lock:
            for run_id, queue in list(self._runs.items()):
                if queue.next_seq in queue.pending:
                    ready.append((queue, *queue.pending[queue.next_seq]))
                elif queue.finishing:
                    self._finalize(run_id, queue)
        return ready

    def queues(self) -> list[RunQueue]:
        with self._lock:
            return list(self._runs.values())

    def holds(self, run_id: str, queue: RunQueue) -> bool:
        """Whether `queue` is still the run's (not cancelled or lost meanwhile)."""
        with self._lock:
            return self._runs.get(run_id) is queue

    def advance(self, operation: OperationRecord) -> None:
        """The operation ended (or was skipped): its run's next seq_id is up."""
        with self._lock:
            queue = self._runs.get(operation.run_id)
            if queue is not None and queue.pending.pop(operation.seq_id, None) is not None:
                queue.next_seq = operation.seq_id + 1
                queue.progress, queue.credit = None, 0

    def end(self, run_id: str, status: OperationStatus, error: dict) -> None:
        """The run's queue goes (cancelled, or lost with its worker): its operation part-way through its
        micro-batches (a single engine call that is running ends) and its queued ones end with `error`."""
        with self._lock:
            queue = self._runs.pop(run_id, None)
        op = queue.part_way() if queue is not None else None
        if op is not None:
            self.store.set_operation(op.id, status, error=error)
            self.ends.notify(op.id)
        for op_id in self.store.end_queued(run_id, status, error):
            self.ends.notify(op_id)

    def _finalize(self, run_id: str, queue: RunQueue) -> None:
        """A finishing run is drained: cancel what waits behind a missing seq_id, free its adapter."""
        del self._runs[run_id]
        for seq, (op, _) in queue.pending.items():
            self.store.set_operation(op.id, OperationStatus.CANCELLED, error={
                "code": "cancelled",
                "message": f"run finished before seq_id {seq} could run (seq_id {queue.next_seq} never arrived)"})
            self.ends.notify(op.id)
        self.backend.delete_run(run_id)
        self.store.set_run_status(run_id, RunStatus.FINISHED)
