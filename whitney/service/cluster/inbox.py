"""The leader's side: what it does once it holds the lease (`take_over`), then the operations and calls it takes
from the database (`Inbox`), woken by their notifications.

Taking over, the new leader ends what the former one left half done, in one transaction carrying its fence:
  - a live run its backend does not hold (an in-process engine's runs died with the former leader; a Ray trainer
    that still lives holds its own) is interrupted, as a run lost with its worker is: its queued and running
    operations fail with worker_lost, and the client resumes it from a checkpoint with a new run (a run being
    cancelled is cancelled);
  - an operation that was running ends exactly once: the former leader stored its result (it succeeded), or it
    fails with worker_lost (its run, if it has one, is interrupted above or here, since what it did to the run's
    state is unknown);
  - a queued operation stored without its job (a streaming sample, which lived on the former leader's
    connection) fails with worker_lost;
  - a leader call it was making fails with Unavailable (calls.py; the caller retries).
Every other queued operation is the new leader's to run, in seq_id order per run, as its Inbox reads them.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Callable

from sqlalchemy import text

from whitney.protocol.backend import WorkerLost
from whitney.service.cluster.calls import LeaderSide, fail_running
from whitney.service.cluster.payloads import SampleJob, ScoreJob, decode, forget, package_read
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.scheduling.streams import SampleStream
from whitney.service.store.database import Store
from whitney.service.store.packages import release, release_at_end
from whitney.service.store.records import OperationRecord, record

log = logging.getLogger(__name__)
_QUEUED_JOBS = text("SELECT o.*, p.job FROM operations o JOIN operation_payloads p ON p.op_id = o.id "
                    "WHERE o.id = ANY(:ids) AND o.status = 'queued' ORDER BY o.created_at")

LOST = {"code": WorkerLost.code, "category": "server",
        "message": "the scheduling leader running this operation stopped before storing its result"}
RUN_LOST = "its scheduling leader stopped and its state did not survive; resume from the newest checkpoint with a new run"


def take_over(store: Store, held_runs: set[str]) -> set[str]:
    """End what the former leader left half done (see the module docstring); the runs interrupted."""
    now = time.time()
    with store.engine.begin() as conn:
        running = conn.execute(text("SELECT id, run_id FROM operations WHERE status = 'running'")).all()
        stranded = conn.execute(text(
            "SELECT o.id FROM operations o LEFT JOIN operation_payloads p ON p.op_id = o.id "
            "WHERE o.status = 'queued' AND p.op_id IS NULL")).all()
        lost_runs = {r for (r,) in conn.execute(text(
            "SELECT id FROM runs WHERE status IN ('active', 'finishing', 'cancelling')")).all() if r not in held_runs}
        lost_runs |= {run_id for _, run_id in running if run_id is not None}
        ended = [op_id for op_id, _ in running] + [op_id for (op_id,) in stranded]
        if lost_runs:
            ended += [op_id for (op_id,) in conn.execute(text(
                "SELECT id FROM operations WHERE status = 'queued' AND run_id = ANY(:runs)"),
                {"runs": list(lost_runs)}).all()]
        ended = sorted(set(ended))
        conn.execute(text("UPDATE operations SET status = 'failed', error = :error, finished_at = :now "
                          "WHERE id = ANY(:ids) AND status IN ('queued', 'running')"),
                     {"ids": ended, "error": json.dumps(LOST), "now": now})
        # A run being cancelled is cancelled: what it held went with the former leader.
        conn.execute(text("UPDATE runs SET status = CASE WHEN status = 'cancelling' THEN 'cancelled' ELSE "
                          "'interrupted' END, error = CASE WHEN status = 'cancelling' THEN error ELSE :error END "
                          "WHERE id = ANY(:ids) AND status IN ('active', 'finishing', 'cancelling')"),
                     {"ids": list(lost_runs), "error": RUN_LOST})
        reads = [package_read(decode(bytes(job))) for (job,) in conn.execute(text(
            "SELECT job FROM operation_payloads WHERE op_id = ANY(:ids)"), {"ids": ended}).all()] if ended else []
        forget(conn, ended)
        fail_running(conn)
    for path in reads:  # their readers were counted by the routes that queued them, and never released
        if path is not None:
            release(store, path)
    log.info("took over scheduling: %d operations the former leader left failed, %d runs interrupted, %d runs "
             "held by the workers go on", len(ended), len(lost_runs), len(held_runs - lost_runs))
    return lost_runs


def run_statuses(store: Store, runs: set[str]) -> dict[str, str]:
    """Each run's status in the store."""
    with store.engine.connect() as conn:
        return dict(conn.execute(text("SELECT id, status FROM runs WHERE id = ANY(:runs)"), {"runs": list(runs)}).all())


def next_seq_ids(store: Store, runs: set[str]) -> dict[str, int]:
    """Each run's next seq_id to run: one past the last that ended (every one before it has ended too)."""
    if not runs:
        return {}
    with store.engine.connect() as conn:
        ended = dict(conn.execute(text(
            "SELECT run_id, MAX(seq_id) FROM operations WHERE run_id = ANY(:runs) AND seq_id IS NOT NULL "
            "AND status IN ('succeeded', 'failed', 'cancelled') GROUP BY run_id"), {"runs": list(runs)}).all())
    return {run_id: ended.get(run_id, -1) + 1 for run_id in runs}


class Inbox:
    """Queued operations read with their jobs and handed to the scheduler (each once), and leader calls made; run
    whenever a submission's notification arrives (`wake`) and once on start. A streaming sample whose listener a
    route of this process holds streams into it as its tokens come."""

    def __init__(self, store: Store, scheduler: Scheduler, stream_of: Callable[[str], SampleStream | None],
                 calls: LeaderSide):
        self.store = store
        self.scheduler = scheduler
        self.stream_of = stream_of  # a streaming sample's listener, where a route of this process holds one
        self.calls = calls
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._known: set[str] = set()  # queued operations already handed over
        self._thread = threading.Thread(target=self._run, name="whitney-inbox", daemon=True)

    def start(self) -> None:
        self._wake.set()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def wake(self) -> None:
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.calls.take()
                self.take()
            except Exception:
                log.exception("reading submitted work failed; again at the next submission")

    def take(self) -> None:
        """Hand the scheduler every queued operation it has not had, oldest first."""
        with self.store.engine.connect() as conn:
            queued = [op_id for (op_id,) in conn.execute(text(
                "SELECT o.id FROM operations o JOIN operation_payloads p ON p.op_id = o.id "
                "WHERE o.status = 'queued' ORDER BY o.created_at"))]
            new = [op_id for op_id in queued if op_id not in self._known]
            rows = conn.execute(_QUEUED_JOBS, {"ids": new}).all() if new else []  # still queued, oldest first
        for row in rows:
            job = decode(bytes(row.job))
            operation = record(OperationRecord, row)
            if (path := package_read(job)) is not None:  # the route counted its reader; released as it ends here
                release_at_end(self.store, operation.id, path)
            if isinstance(job, SampleJob):
                listener = self.stream_of(operation.id)
                self.scheduler.submit_sample(operation, job.prompt, job.params, job.weights,
                                             stream=listener is not None, listener=listener)
            elif isinstance(job, ScoreJob):
                self.scheduler.submit_logprobs(operation, job.sequences, job.weights)
            else:
                self.scheduler.submit(operation, job)
        self._known = set(queued)
