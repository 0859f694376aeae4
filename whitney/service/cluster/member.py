"""One API process of a highly available service (`whitney serve --ha`): its role, follower or leader, and the
threads that keep it.

Every member answers the whole API from the shared PostgreSQL database (dispatch.py). A follower campaigns for the
scheduling lease (lease.py) every third of its length; the one that takes it becomes the leader: it fences its
store's writes with the lease's token, ends what the former leader left half done (inbox.take_over), reads the
queued work (inbox.Inbox) and runs its scheduler. The leader renews its lease every third of its length; once it
finds the lease taken (or cannot renew it before it expires: a lost database) it steps down, which in
`whitney serve` ends the process (its supervisor starts it again, a follower): its engine's state cannot be trusted
to match the database any more, and its fence has kept it from writing since the lease was taken.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
import uuid
from typing import Callable

from sqlalchemy import create_engine

from whitney.errors import InvalidInput
from whitney.service.cluster import lease, payloads
from whitney.service.cluster.calls import CALL, CallerSide, LeaderSide
from whitney.service.cluster.dispatch import Dispatch
from whitney.service.cluster.inbox import Inbox, next_seq_ids, run_statuses, take_over
from whitney.service.cluster.notify import ENDED, SUBMITTED, Listener
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.store.database import Store

log = logging.getLogger(__name__)
LEASE_SECONDS = 5.0


class Member:
    """This process's membership: its dispatch (what the routes use), its lease campaign and, once it leads, its
    inbox and scheduler. `on_lost()` is called when it stops leading (default: the process exits)."""

    def __init__(self, store: Store, scheduler: Scheduler, lease_seconds: float = LEASE_SECONDS,
                 on_lost: Callable[[], None] | None = None):
        if store.engine.dialect.name != "postgresql":
            raise InvalidInput("a highly available service (--ha) needs a PostgreSQL --db-url: its members share "
                               "the database, its lease and its notifications", field="db_url")
        self.store, self.scheduler, self.seconds = store, scheduler, lease_seconds
        self.holder = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.url: str | None = None  # where this process serves HTTP, once it does (shown to others)
        self.on_lost = on_lost or _exit
        self.fence = lease.Fence(self.holder)
        lease.install_fence(store.engine, self.fence, self._lost)
        store.queued, store.ended = payloads.store, payloads.forget
        self.caller = CallerSide(store)
        self.dispatch = Dispatch(scheduler, self.caller)
        self.inbox = Inbox(store, scheduler, self.dispatch.stream_of, LeaderSide(store, {
            "open_run": scheduler.open_run, "finish_run": scheduler.finish_run,
            "cancel_run": scheduler.cancel_run, "cancel_sample": scheduler.cancel_sample}))
        self.listener = Listener(store.engine, {SUBMITTED: self._submitted, ENDED: self._ended},
                                 on_connect=[self.caller.recheck, self.inbox.wake])
        # The lease's own connections: its renewals never wait behind the store's pool, and are never fenced.
        self._lease_engine = create_engine(store.engine.url, pool_size=1, max_overflow=1)
        for engine in (store.engine, self._lease_engine):  # a stalled process must not hold the lease's row
            lease.end_stalled_transactions(engine, lease_seconds)
        self.elected = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._campaign, name="whitney-lease", daemon=True)

    @property
    def role(self) -> str:
        return "leader" if self.fence.token is not None else "follower"

    def leader(self) -> lease.LeaseHolder | None:
        return lease.holder_of(self._lease_engine)

    def start(self) -> None:
        """Listen for notifications and campaign for the lease (`elected` is set once this process leads)."""
        self.listener.start()
        self.listener.connected.wait(timeout=30)
        self._thread.start()

    def lead(self, start_scheduler: bool) -> None:
        """Once elected: take over, read the queued work, schedule (its loop on threads of its own with
        `start_scheduler`, else the caller runs `scheduler.run()`)."""
        backend = self.scheduler.backend
        held = set(backend.adopt())  # an in-process engine holds no run (runs are made by leaders); Ray workers may
        interrupted = take_over(self.store, held)
        for run_id in interrupted & held:  # its state is unknown (it was running): not to go on
            backend.delete_run(run_id)
        adopted = held - interrupted
        for run_id, next_seq in next_seq_ids(self.store, adopted).items():
            self.scheduler.queues.open(run_id, next_seq)
        self.inbox.calls.take()
        self.inbox.take()  # the queued work, before a finishing run is told it may finish
        for run_id, status in run_statuses(self.store, adopted).items():
            if status == "finishing":
                self.scheduler.queues.finish(run_id)
            elif status == "cancelling":
                self.scheduler.cancel_run(run_id, "run cancelled")
        self.dispatch.leading.set()
        self.inbox.start()
        if start_scheduler:
            self.scheduler.start()

    def stop(self) -> None:
        """A clean stop: the lease is given up at once (the next leader need not wait for it to expire)."""
        self._stop.set()
        self.inbox.stop()
        self.listener.stop()
        token = self.fence.token
        if token is not None:
            try:
                lease.release(self._lease_engine, self.holder, token)
            except Exception:
                log.warning("could not give the lease up; it expires in at most %.0f s", self.seconds)

    # ---- the lease ----------------------------------------------------------------------------

    def _campaign(self) -> None:
        """Every third of the lease: try to take it (a follower), or renew it (the leader)."""
        renewed = time.monotonic()
        while not self._stop.is_set():
            try:
                if self.fence.token is None:
                    token = lease.acquire(self._lease_engine, self.holder, self.seconds, self.url)
                    if token is not None:
                        self.fence.token, renewed = token, time.monotonic()
                        log.info("this process leads scheduling now (lease token %d)", token)
                        self.elected.set()
                elif lease.renew(self._lease_engine, self.holder, self.fence.token, self.seconds, self.url):
                    renewed = time.monotonic()
                else:
                    self._lost()
            except Exception as e:  # the database is unreachable: a leader that cannot renew in time steps down
                log.warning("the lease could not be read or renewed: %s", e)
                if self.fence.token is not None and time.monotonic() - renewed > self.seconds:
                    self._lost()
            self._stop.wait(self.seconds / 3)

    def _lost(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        log.error("this process no longer leads scheduling (its lease was taken or expired); stepping down")
        self.on_lost()

    # ---- notifications ------------------------------------------------------------------------

    def _submitted(self, payload: str) -> None:
        if self.dispatch.leading.is_set():
            self.inbox.wake()

    def _ended(self, payload: str) -> None:
        if payload.startswith(CALL):
            self.caller.answered(payload[len(CALL):])
        else:
            self.store.at_end.pop(payload, None)  # a route's hook here: the process that ended it ran its own
            self.dispatch.ends.ended(payload)


def _exit() -> None:
    logging.shutdown()
    os._exit(3)
