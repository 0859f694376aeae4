"""An operation's end: its store move (logged), the ends of a turn written in one transaction, and then whoever
waits on them woken: long-polls (`Ends.wait`) and a streaming sample's listener (`SampleStream`).

Each end is logged at INFO (kind, id, run and seq_id, outcome, seconds since it was submitted); an error of the
server's own at ERROR, with its traceback where there is one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from whitney.protocol.backend import Failure
from whitney.service.scheduling.streams import SampleStream
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OPERATION_TERMINAL, FailureCategory, OperationStatus
from whitney.service.store.records import OperationRecord

log = logging.getLogger(__name__)

# (operation, result, error): how an operation ended, as the lanes hand it here.
End = tuple[OperationRecord, dict | None, BaseException | Failure | None]


def end_move(operation: OperationRecord, result: dict | None, error: BaseException | Failure | None) -> tuple:
    """The store move (op_id, status, result, error) of an operation that ended with `result` or `error`, logged."""
    failure = None if error is None else error if isinstance(error, Failure) else Failure.of(error)
    if failure is not None and failure.category == FailureCategory.SERVER:
        log.error("operation %s (%s) failed: %s", operation.id, operation.kind, failure.message,
                  exc_info=error if isinstance(error, BaseException) else None)
    elif log.isEnabledFor(logging.INFO):
        run = f" of run {operation.run_id} (seq_id {operation.seq_id})" if operation.run_id else ""
        outcome = "succeeded" if failure is None else f"failed ({failure.code}: {failure.message})"
        log.info("%s %s%s %s, %.2f s after it was submitted", operation.kind, operation.id, run, outcome,
                 time.time() - operation.created_at)
    if failure is None:
        return operation.id, OperationStatus.SUCCEEDED, result, None
    return operation.id, OperationStatus.FAILED, None, failure.to_dict()


class Ends:
    """Writes operations' ends and wakes their waiters: the long-polls of any event loop, and the listeners of
    streaming samples (by operation id). `lock` is the scheduler's (waiters are woken while it is held)."""

    def __init__(self, store: Store, lock: threading.RLock):
        self.store = store
        self._lock = lock
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self.streams: dict[str, SampleStream] = {}  # streaming samples' listeners, by operation id

    def listen(self, op_id: str, listener: SampleStream | None = None) -> SampleStream:
        """A listener for the streaming sample `op_id` (a new one, or `listener`): its reports, then its end."""
        listener = listener or SampleStream()
        with self._lock:
            self.streams[op_id] = listener
        return listener

    def listener(self, op_id: str) -> SampleStream | None:
        with self._lock:
            return self.streams.get(op_id)

    def drop_stream(self, op_id: str) -> None:
        with self._lock:
            self.streams.pop(op_id, None)

    async def wait(self, op_id: str, timeout: float) -> None:
        """Return when the operation may have become terminal, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiters.setdefault(op_id, []).append((loop, future))
        try:
            if (await asyncio.to_thread(self.store.get_operation, op_id)).status in OPERATION_TERMINAL:
                return  # a store read: off the event loop
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                waiters = self._waiters.get(op_id, [])
                if (loop, future) in waiters:
                    waiters.remove((loop, future))

    def notify(self, op_id: str) -> None:
        """The operation's status moved: its long-polls look again."""
        with self._lock:
            waiters = self._waiters.pop(op_id, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    def finish_all(self, ends: list[End], ended_at: list[float | None] | None = None) -> None:
        """Each (operation, result, error) stored in one transaction (`ended_at`: each one's end, if earlier);
        then waiters and listeners woken."""
        if ends:
            self.store.set_operations([end_move(*end) for end in ends], ended_at)
        for operation, _, _ in ends:
            self.ended(operation.id)

    def ended(self, op_id: str) -> None:
        """The operation is terminal (stored): its long-polls look again, its stream's listener is told."""
        self.notify(op_id)
        with self._lock:
            listener = self.streams.pop(op_id, None)
        if listener is not None:
            listener.end()
