"""The scheduler's bookkeeping: a run's queue of operations by seq_id, an operation part-way through its
micro-batches, a compute_logprobs request scored chunk by chunk, a worker thread's lane of calls, a
streaming sample's reports on their way to the HTTP request that waits for them, and an ended operation's
store move."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable

from whitney.protocol.backend import Backend, Failure, Weights
from whitney.protocol.sampling import SampleProgress, SampleResult
from whitney.protocol.training import ForwardResult, merge_results
from whitney.service.api.images import known_length
from whitney.service.scheduling.jobs import Job, forward_result_dict, sample_result_dict
from whitney.service.scheduling.limits import plan_micro_batches
from whitney.service.store.lifecycle import OperationStatus

log = logging.getLogger("whitney.scheduler")


@dataclass
class Progress:
    """A forward/forward_backward operation part-way through its micro-batches."""

    done: int = 0  # datums already run
    parts: list[ForwardResult] = field(default_factory=list)
    staged: bool = False  # runs in more than one micro-batch: its gradient is staged under its id


def end_of_part(backend: Backend, operation: dict, progress: Progress, result: ForwardResult | Failure, start: int,
                end: int, datums: int, backward: bool) -> tuple | None:
    """An engine call's result for the operation's datums [start, end): its end (operation, result, failure) once
    the operation is whole or has failed, else None (micro-batches to come). A bug while ending it (merging the
    parts, committing a staged gradient) fails this operation as a server error rather than leaving it running."""
    try:
        if isinstance(result, Failure):
            if progress.staged:
                backend.settle_gradients(operation["run_id"], operation["id"], keep=False)
            if result.datum_index is not None:  # the index within the whole operation
                result = replace(result, datum_index=result.datum_index + start)
            return operation, None, result
        progress.parts.append(result)
        progress.done = end
        if end < datums:
            return None
        if progress.staged and backward:
            backend.settle_gradients(operation["run_id"], operation["id"], keep=True)
        return operation, forward_result_dict(merge_results(progress.parts)), None
    except Exception as e:
        if progress.staged:
            try:
                backend.settle_gradients(operation["run_id"], operation["id"], keep=False)
            except Exception:
                log.exception("discarding the staged gradient of %s failed too", operation["id"])
        return operation, None, e


@dataclass
class RunQueue:
    next_seq: int = 0
    pending: dict[int, tuple[dict, Job]] = field(default_factory=dict)  # seq_id -> (operation, job)
    finishing: bool = False
    progress: Progress | None = None  # of the operation at next_seq, once its first micro-batch ran
    served: int = 0  # the engine call that last ran its work (fairness: the least recently served first)
    starved: bool = False  # got no datum in the last engine call it was ready for
    # When it last had a forward/forward_backward ready (engine call count, monotonic time) and its tokens:
    # for a while after, its share of each call is reserved (`plan_micro_batches`).
    active_call: int = -(10**9)
    active_at: float = -1e18
    active_tokens: int = 0


@dataclass
class Lane:
    """One worker thread's queue of calls to run on it, and the event that wakes it."""

    name: str
    calls: list[tuple[Callable, concurrent.futures.Future]] = field(default_factory=list)
    wake: threading.Event = field(default_factory=threading.Event)


@dataclass
class Scoring:
    """A compute_logprobs request, scored a chunk of sequences per worker iteration."""

    operation: dict
    sequences: list[list[int]]
    weights: Weights
    done: int = 0
    logprobs: list = field(default_factory=list)

    def score_chunk(self, backend: Backend, max_batch_tokens: int) -> Failure | None:
        """Score the next chunk of sequences (at most max_batch_tokens tokens); its Failure (datum_index
        within the whole request), or None."""
        lengths = [known_length(s) for s in self.sequences[self.done:]]  # positions, an image as its expected_tokens
        (count,) = plan_micro_batches([lengths], max_batch_tokens, [False])
        try:
            self.logprobs += backend.compute_logprobs(self.sequences[self.done:self.done + count], self.weights)
        except BaseException as e:
            error = Failure.of(e)
            return error if error.datum_index is None else replace(error, datum_index=error.datum_index + self.done)
        self.done += count
        return None


class SampleStream:
    """A streaming sample's progress reports, from the sampling thread (`put`, `end`) to the event loop of
    the HTTP request that streams them (`get`). Thread-safe; nothing is dropped or reordered."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reports: list[SampleProgress] = []
        self._ended = False
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None

    def put(self, report: SampleProgress) -> None:
        with self._lock:
            self._reports.append(report)
            self._wake()

    def end(self) -> None:
        """The operation is terminal (its result or error is in the store): no report follows."""
        with self._lock:
            self._ended = True
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None:
            loop, future = self._waiter
            self._waiter = None
            try:
                loop.call_soon_threadsafe(lambda: future.done() or future.set_result(None))
            except RuntimeError:  # the request's loop has closed: nobody is listening
                pass

    async def get(self, timeout: float) -> tuple[list[SampleProgress], bool]:
        """The reports since the last call (waiting up to `timeout` seconds for one), and whether the
        operation has ended (then every report has been handed out)."""
        future = None
        with self._lock:
            if not self._reports and not self._ended:
                loop = asyncio.get_running_loop()
                future = loop.create_future()
                self._waiter = (loop, future)
        if future is not None:
            try:
                await asyncio.wait_for(future, timeout)
            except asyncio.TimeoutError:
                pass
        with self._lock:
            self._waiter = None
            reports, self._reports = self._reports, []
            return reports, self._ended


def sample_result(result: SampleResult) -> dict:
    """A sample's stored result: `sample_result_dict`, with each sequence's top_logprobs where asked for."""
    out = sample_result_dict(result)
    for wire, sequence in zip(out["sequences"], result.sequences):
        if sequence.top_logprobs is not None:
            wire["top_logprobs"] = sequence.top_logprobs
    return out


def end_move(operation: dict, result: dict | None, error: BaseException | Failure | None) -> tuple:
    """The store move (op_id, status, result, error) of an operation that ended with `result` or `error`.
    Each end is logged at INFO (kind, id, run and seq_id, outcome, seconds since it was submitted); an error of
    the server's own at ERROR, with its traceback where there is one."""
    failure = None if error is None else error if isinstance(error, Failure) else Failure.of(error)
    if failure is not None and failure.category == "server":
        log.error("operation %s (%s) failed: %s", operation["id"], operation["kind"], failure.message,
                  exc_info=error if isinstance(error, BaseException) else None)
    elif log.isEnabledFor(logging.INFO):
        run = f" of run {operation['run_id']} (seq_id {operation['seq_id']})" if operation.get("run_id") else ""
        outcome = "succeeded" if failure is None else f"failed ({failure.code}: {failure.message})"
        log.info("%s %s%s %s, %.2f s after it was submitted", operation["kind"], operation["id"], run, outcome,
                 time.time() - operation.get("created_at", time.time()))
    if failure is None:
        return operation["id"], OperationStatus.SUCCEEDED, result, None
    return operation["id"], OperationStatus.FAILED, None, failure.to_dict()
