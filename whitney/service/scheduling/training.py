"""The training lane: one iteration is one engine call of ready forward/forward_backward work of different
runs, shared max-min fairly (`limits.plan_micro_batches`), then every other ready training operation: every
optim_step in one backend call (`optim_steps`), loads and saves one by one (`saves.py`).

An operation larger than its share runs as several micro-batches, one per engine call, its gradient staged in
the backend until the last one succeeded, with other runs' work in between. A batch's starts are one store
statement, an iteration's ends one transaction.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from whitney.protocol.backend import Backend, Failure
from whitney.protocol.training import AdamParams, ForwardRequest, ForwardResult, merge_results
from whitney.service.scheduling.ends import End, Ends
from whitney.service.scheduling.jobs import ForwardJob, Job, OptimJob, Refused
from whitney.service.scheduling.limits import plan_micro_batches
from whitney.service.scheduling.results import forward_result_dict
from whitney.service.scheduling.run_queues import Progress, RunQueue, RunQueues
from whitney.service.scheduling.saves import execute
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind, OperationStatus
from whitney.service.store.records import OperationRecord

log = logging.getLogger(__name__)


def end_of_part(backend: Backend, operation: OperationRecord, progress: Progress, result: ForwardResult | Failure,
                start: int, end: int, datums: int, backward: bool) -> End | None:
    """An engine call's result for the operation's datums [start, end): its end (operation, result, failure) once
    the operation is whole or has failed, else None (micro-batches to come). A bug while ending it (merging the
    parts, committing a staged gradient) fails this operation as a server error rather than leaving it running."""
    try:
        if isinstance(result, Failure):
            if progress.staged:
                backend.settle_gradients(operation.run_id, operation.id, keep=False)
            if result.datum_index is not None:  # the index within the whole operation
                result = replace(result, datum_index=result.datum_index + start)
            return operation, None, result
        progress.parts.append(result)
        progress.done = end
        if end < datums:
            return None
        if progress.staged and backward:
            backend.settle_gradients(operation.run_id, operation.id, keep=True)
        return operation, forward_result_dict(merge_results(progress.parts)), None
    except Exception as e:
        if progress.staged:
            try:
                backend.settle_gradients(operation.run_id, operation.id, keep=False)
            except Exception:
                log.exception("discarding the staged gradient of %s failed too", operation.id)
        return operation, None, e


class Training:
    """Runs the runs' training operations in seq_id order on the training thread (the backend's only caller
    for training). `max_batch_tokens`: the tokens of one engine call; a run that had training work ready within
    the last two engine calls or `recent_seconds` keeps its share of each call reserved while its next operation
    is on its way."""

    def __init__(self, backend: Backend, store: Store, data_dir: Path, queues: RunQueues, ends: Ends,
                 max_batch_tokens: int, recent_seconds: float):
        self.backend = backend
        self.store = store
        self.data_dir = Path(data_dir)
        self.queues = queues
        self.ends = ends
        self.max_batch_tokens = max_batch_tokens
        self.recent_seconds = recent_seconds
        self.calls_made = 0  # engine training calls so far (the fairness clock)
        self.seconds = 0.0  # the last iteration's time: sampling's share after it

    def step(self) -> bool:
        """One engine call of ready forward/forward_backward work (fairly shared), then every ready
        operation of the other kinds, counting those the engine call made ready (the optim_step behind each
        forward_backward goes now, not after the next engine call). All their ends are stored in one
        transaction, each with its own end time: the woken clients' next requests do not slow those
        optim_steps. An operation that ended while queued (its run cancelled: the store refuses its RUNNING
        move) is skipped, and its run's order moves on."""
        ready = self.queues.ready()
        if not ready:
            self.seconds = 0.0
            return False
        start = time.monotonic()
        batched = [item for item in ready if isinstance(item[2], ForwardJob)]
        held, held_at = [], 0.0
        if batched:
            held, held_at = self._batch(batched), time.time()
            ready = self.queues.ready()
        singles = [(op, job) for _, op, job in ready if not isinstance(job, ForwardJob)]
        ends: list[End] = []  # the engine call's ends are stored even if a bug stops the rest
        try:
            ends = self._singles(singles) if singles else []
        finally:
            self.ends.finish_all(held + ends, [held_at] * len(held) + [None] * len(ends))
        for op, _, _ in ends:
            self.queues.advance(op)
        self.seconds = time.monotonic() - start
        return True

    def _shares(self, items: list[tuple[RunQueue, OperationRecord, ForwardJob]], now: float) -> list[int]:
        """How many datums of each item the next engine call runs, each run's share reserved for a while after
        it last had work ready, by deficit round robin (`plan_micro_batches`): the items' credits move on."""
        remaining = [job.shares[queue.progress.done if queue.progress else 0:] for queue, _, job in items]
        waiting = {id(q) for q, _, _ in items}
        reserved = [q.active_tokens for q in self.queues.queues() if id(q) not in waiting and q.active_tokens
                    and (self.calls_made - q.active_call <= 2 or now - q.active_at <= self.recent_seconds)]
        counts, credit = plan_micro_batches(remaining, self.max_batch_tokens, [q.credit for q, _, _ in items], reserved)
        for (queue, _, _), earned in zip(items, credit):
            queue.credit = earned
        return counts

    def _batch(self, ready: list[tuple[RunQueue, OperationRecord, ForwardJob]]) -> list[End]:
        """One engine call: the least recently served run's kind (forward or forward_backward), and the
        ready operations of that kind, each whole or a micro-batch of it. Returns the (operation, result,
        failure) it ended, for the caller to store; their runs' orders moved on."""
        ready.sort(key=lambda item: item[0].served)
        kind = ready[0][1].kind
        items = [item for item in ready if item[1].kind == kind]
        now = time.monotonic()
        for queue, _, job in ready:
            queue.active_call, queue.active_at = self.calls_made, now
            queue.active_tokens = min(sum(job.shares), self.max_batch_tokens)
        counts = self._shares(items, now)
        self.calls_made += 1
        starting = [op.id for (queue, op, _), count in zip(items, counts) if count and queue.progress is None]
        moved = dict(zip(starting, self.store.set_operations([(i, OperationStatus.RUNNING, None, None)
                                                              for i in starting]))) if starting else {}
        planned, requests = [], []
        for (queue, op, job), count in zip(items, counts):
            if count == 0:
                continue
            if queue.progress is None:
                if not moved[op.id]:  # ended while queued (cancelled): skipped, the order moves on
                    self.queues.advance(op)
                    continue
                queue.progress = Progress(staged=count < len(job.data))
            queue.served = self.calls_made
            start = queue.progress.done
            planned.append((queue, op, job, start, start + count))
            requests.append(ForwardRequest(op.run_id, job.data[start:start + count], job.loss_fn, job.loss_config,
                                           stage=op.id if queue.progress.staged else None))
        if not requests:  # every datum planned ended while queued (cancelled)
            return []
        backward = kind == OperationKind.FORWARD_BACKWARD
        try:
            results = self.backend.run_batch(requests, backward=backward)
        except BaseException as e:  # a bug: every operation of the batch fails as a server error
            log.exception("run_batch failed")
            results = [Failure.of(e)] * len(requests)
        ends: list[End] = []
        for (queue, op, job, start, end), result in zip(planned, results):
            if not self.queues.holds(op.run_id, queue):  # cancelled meanwhile: cancel_run answered it
                continue
            ended = end_of_part(self.backend, op, queue.progress, result, start, end, len(job.data), backward)
            if ended is not None:
                ends.append(ended)
        for op, _, _ in ends:
            self.queues.advance(op)
        return ends

    def _singles(self, items: list[tuple[OperationRecord, Job]]) -> list[End]:
        """Ready operations other than forwards, of different runs: started in one store statement, every
        optim_step in one backend call (`optim_steps`), loads and saves one by one; returns their ends."""
        moved = self.store.set_operations([(op.id, OperationStatus.RUNNING, None, None) for op, _ in items])
        ends: list[End] = []
        steps: list[tuple[OperationRecord, AdamParams]] = []
        for (op, job), ok in zip(items, moved):
            if not ok:  # ended while queued (cancelled): skipped, the order moves on
                continue
            if isinstance(job, Refused):
                ends.append((op, None, job.failure))
            elif isinstance(job, OptimJob):
                steps.append((op, job.params))
            else:
                try:
                    ends.append((op, execute(self.backend, self.store, self.data_dir, op, job), None))
                except BaseException as e:
                    ends.append((op, None, e))
        if steps:
            try:
                results = self.backend.optim_steps([(op.run_id, params) for op, params in steps])
            except BaseException as e:  # a bug: each of these steps fails as a server error
                log.exception("optim_steps failed")
                results = [Failure.of(e)] * len(steps)
            ends += [(op, None, r) if isinstance(r, Failure) else (op, {"metrics": r}, None)
                     for (op, _), r in zip(steps, results)]
        for (op, _), ok in zip(items, moved):
            if not ok:  # skipped: no end to store, but its run's order moves on
                self.queues.advance(op)
        return ends
