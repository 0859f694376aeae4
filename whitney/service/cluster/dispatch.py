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
        # Long-polls and streaming samples' listeners, woken by end notifications (`ended`).
        self.ends = Ends(scheduler.store, threading.RLock())
        self.leading = threading.Event()
        # A follower's own engine calls (a console export: its backend is idle): one at a time, off the event loop.
        self._own = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="whitney-follower")

    def submit(self, operation: OperationRecord, job: Job) -> None:
        """Nothing more: the route stored the job with the operation, and its notification wakes the leader."""

    def submit_sample(self, operation: OperationRecord, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> SampleStream | None:
        """Stored with its job (the leader samples). A streaming sample's listener: the leader's inbox streams into
        it when it is this process and finds it (`stream_of`); else it ends with the operation, and the route sends
        the whole completion then."""
        return self.ends.listen(operation.id) if stream else None

    def stream_of(self, op_id: str) -> SampleStream | None:
        return self.ends.listener(op_id)

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
        self.ends.drop_stream(op_id)
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
