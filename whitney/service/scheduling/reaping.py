"""What ends without a client asking, checked on the training thread between iterations: runs the backend
lost (with a dying worker, or whose paged-out state could not be read back: interrupted, their waiting operations
failed with `worker_lost`), sessions without a heartbeat for `session_timeout` seconds (expired, their open runs
cancelled), and checkpoints past their TTL that no one is reading (deleted: store/packages.py `reap`)."""

from __future__ import annotations

import logging
import time
from typing import Callable

from whitney.protocol.backend import Housekeeping
from whitney.service.scheduling.run_queues import RunQueues
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import RUN_OPEN, FailureCategory, OperationStatus, RunStatus, SessionStatus
from whitney.service.store.packages import reap

log = logging.getLogger(__name__)


class Reaper:
    """`cancel_run(run_id, reason)`: the scheduler's, for an expired session's runs. `expiry_interval`: seconds
    between passes over sessions and checkpoints."""

    def __init__(self, backend: Housekeeping, store: Store, queues: RunQueues,
                 cancel_run: Callable[[str, str], None], session_timeout: float, expiry_interval: float):
        self.backend = backend
        self.store = store
        self.queues = queues
        self.cancel_run = cancel_run
        self.session_timeout = session_timeout
        self.expiry_interval = expiry_interval
        self._last_expiry_check = 0.0

    def interrupt_lost_runs(self) -> bool:
        """Runs whose state the backend lost (their worker died, or their paged-out state could not be read
        back): each is interrupted, and its operation part-way through micro-batches and its queued ones fail
        with worker_lost."""
        lost = self.backend.take_lost_runs()
        for run_id in lost:
            message = (f"run {run_id} lost its state (its worker died, or its state paged out to disk could not be "
                       "read back); it is interrupted: resume from its newest saved state with a new run")
            # Interrupted first: the store then refuses the run new operations (409), so none submitted while
            # its queued ones end is left queued behind them.
            self.store.set_run_status(run_id, RunStatus.INTERRUPTED, error=message)
            self.queues.end(run_id, OperationStatus.FAILED,
                            {"code": "worker_lost", "message": message, "category": FailureCategory.SERVER})
            log.error(message)
        return bool(lost)

    def expire(self) -> None:
        """Every `expiry_interval` seconds: checkpoints past their TTL reaped, idle sessions expired."""
        now = time.time()
        if now - self._last_expiry_check < self.expiry_interval:
            return
        self._last_expiry_check = now
        reap(self.store)
        for session_id in self.store.idle_sessions(now - self.session_timeout):
            self.store.end_session(session_id, SessionStatus.EXPIRED)
            for run in self.store.runs_of_session(session_id):
                if run.status in RUN_OPEN:
                    self.cancel_run(run.id, "session expired")
