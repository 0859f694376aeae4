"""What the routes of an API process in a highly available service talk to, in place of the scheduler itself: the
same calls (`Scheduler`'s), made through the database, so that any process answers any request.

- An operation is queued by the route with its job in the same transaction (payloads.py) and a notification:
  whichever process leads reads it from there (inbox.py), the leader itself too.
- Run creation, finishing and cancelling, and a sample's cancel, are leader calls (calls.py), awaited here.
- A long-poll waits for the operation's end notification (`Ends.wait`, woken by the listener).
- A streaming sample is stored like any other; the leader streams its tokens as they come where the request reached
  the leader itself, and a follower's stream sends the completion whole once the operation ends.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Any, Callable

from whitney.protocol.backend import ServedBackend, Weights
from whitney.protocol.sampling import SamplingParams
from whitney.service.cluster.calls import CallerSide
from whitney.service.scheduling.ends import Ends
from whitney.service.scheduling.jobs import Job
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.scheduling.streams import SampleStream
from whitney.service.store.records import OperationRecord


class Dispatch:
    """The scheduler's interface for the routes, over the database; `scheduler` is this process's own, which runs
    only while it leads (`leading`)."""

    def __init__(self, scheduler: Scheduler, calls: CallerSide):
        self.scheduler = scheduler
        self.backend: ServedBackend = scheduler.backend
        self.calls = calls
        self.ends = Ends(scheduler.store, threading.RLock())  # long-polls, woken by end notifications
        self.leading = threading.Event()
        self._lock = threading.Lock()
        self._streams: dict[str, SampleStream] = {}  # streaming samples' listeners, by operation id
        # A follower's own engine calls (a console export: its backend is idle): one at a time, off the event loop.
        self._own = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="whitney-follower")

    def submit(self, operation: OperationRecord, job: Job) -> None:
        """Nothing more: the route stored the job with the operation, and its notification wakes the leader."""

    def submit_sample(self, operation: OperationRecord, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> SampleStream | None:
        """Stored with its job (the leader samples). A streaming sample's listener: the leader's inbox streams into
        it when it is this process and finds it (`stream_of`); else it ends with the operation, and the route sends
        the whole completion then."""
        if not stream:
            return None
        listener = SampleStream()
        with self._lock:
            self._streams[operation.id] = listener
        return listener

    def stream_of(self, op_id: str) -> SampleStream | None:
        with self._lock:
            return self._streams.get(op_id)

    def ended(self, op_id: str) -> None:
        """The operation ended (its notification): its long-polls woken, its listener (if any) told."""
        with self._lock:
            listener = self._streams.pop(op_id, None)
        if listener is not None:
            listener.end()
        self.ends.notify(op_id)

    def submit_logprobs(self, operation: OperationRecord, sequences: list[list[int]], weights: Weights) -> None:
        """Nothing more: stored with its job."""

    def open_run(self, run_id: str, base_model: str, lora: dict, resume_path: str | None = None,
                 resume_with_optimizer: bool = False) -> concurrent.futures.Future:
        return self.calls.call("open_run", run_id=run_id, base_model=base_model, lora=lora, resume_path=resume_path,
                               resume_with_optimizer=resume_with_optimizer)

    def finish_run(self, run_id: str) -> concurrent.futures.Future:
        return self.calls.call("finish_run", run_id=run_id)

    def cancel_run(self, run_id: str, reason: str = "run cancelled") -> None:
        self.calls.call("cancel_run", run_id=run_id, reason=reason)

    def cancel_sample(self, op_id: str, reason: str = "the sample was cancelled") -> concurrent.futures.Future:
        if self.leading.is_set():
            return self.scheduler.cancel_sample(op_id, reason)
        return self.calls.call("cancel_sample", op_id=op_id, reason=reason)

    def drop_stream(self, op_id: str) -> None:
        with self._lock:
            self._streams.pop(op_id, None)
        if self.leading.is_set():
            self.scheduler.drop_stream(op_id)

    async def wait(self, op_id: str, timeout: float) -> None:
        await self.ends.wait(op_id, timeout)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """fn() on the training thread while leading; a follower's backend is its own and idle: on a thread of its
        own."""
        if self.leading.is_set():
            return self.scheduler.call(fn)
        return self._own.submit(fn)

    def stop(self) -> None:
        self.scheduler.stop()
        self._own.shutdown(wait=False)
