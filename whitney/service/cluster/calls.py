"""Calls an API process asks the scheduling leader to make, through the database: create a run's adapter, finish or
cancel a run, cancel a sample. The caller inserts the call (tables.LeaderCallRow) and notifies the leader; the
leader claims it, makes it on its scheduler, and writes the answer (a WhitneyError as its class, message and field,
raised again in the caller); the caller's future resolves on the answer's notification.

A call still queued when the leader dies is made by the next one; one it was making fails with Unavailable
(`fail_running`), so the caller retries rather than waits; one no leader takes within WAIT_SECONDS (none leads)
is withdrawn and fails with Unavailable too.
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import threading
import time
from typing import Callable

from sqlalchemy import text

from whitney import errors
from whitney.errors import Unavailable, WhitneyError
from whitney.service.cluster.notify import ENDED, SUBMITTED, send
from whitney.service.store.database import Store
from whitney.service.store.tables import new_id

log = logging.getLogger(__name__)
CALL = "call:"  # a notification's payload that names a call, not an operation
WAIT_SECONDS = 60.0  # how long a call waits for a leader to take it


class CallerSide:
    """This process's calls awaiting their answers."""

    def __init__(self, store: Store):
        self.store = store
        self._lock = threading.Lock()
        self._waiting: dict[str, concurrent.futures.Future] = {}

    def call(self, kind: str, **args) -> concurrent.futures.Future:
        """Queue the call for the leader; the future carries its answer (or raises its error). A call no leader
        has taken within WAIT_SECONDS is withdrawn and fails with Unavailable (the client retries); one a leader is
        making is waited for."""
        call_id, future = new_id("call"), concurrent.futures.Future()
        with self._lock:
            self._waiting[call_id] = future
        with self.store.engine.begin() as conn:
            conn.execute(text("INSERT INTO leader_calls (id, kind, args, status, created_at) "
                              "VALUES (:id, :kind, :args, 'queued', :now)"),
                         {"id": call_id, "kind": kind, "args": json.dumps(args), "now": time.time()})
            send(conn, SUBMITTED, CALL + call_id)
        self._check_later(call_id)
        return future

    def _check_later(self, call_id: str) -> None:
        timer = threading.Timer(WAIT_SECONDS, self._withdraw, (call_id,))
        timer.daemon = True
        timer.start()

    def _withdraw(self, call_id: str) -> None:
        """WAIT_SECONDS after the call (or its last check): withdrawn if no leader took it, else checked again."""
        if not self._awaited(call_id):
            return
        with self.store.engine.begin() as conn:
            withdrawn = conn.execute(text("UPDATE leader_calls SET status = 'failed', finished_at = :now "
                                          "WHERE id = :id AND status = 'queued'"),
                                     {"id": call_id, "now": time.time()}).rowcount == 1
        if not withdrawn:  # a leader is making it (or answered it: the notification resolves it)
            self.answered(call_id)
            self._check_later(call_id)
            return
        self._resolve(call_id, error=Unavailable(f"no scheduling leader took this request within {WAIT_SECONDS:g} "
                                                 "s; retry (GET /healthz says which process leads)"))

    def answered(self, call_id: str) -> None:
        """A call's answer was written (its notification): resolve its future, if it is this process's."""
        if not self._awaited(call_id):
            return
        with self.store.engine.connect() as conn:
            row = conn.execute(text("SELECT status, answer FROM leader_calls WHERE id = :id"), {"id": call_id}).first()
        if row is None or row.status not in ("done", "failed") or row.answer is None:  # none yet, or withdrawn
            return
        answer = row.answer  # a JSON column: read back as a dict
        if row.status == "done":
            self._resolve(call_id, value=answer.get("value"))
        else:
            self._resolve(call_id, error=_error(answer))

    def _awaited(self, call_id: str) -> bool:
        with self._lock:
            return call_id in self._waiting

    def _resolve(self, call_id: str, value=None, error: BaseException | None = None) -> None:
        """The call's future resolved with `value` or `error`, once (a second resolution finds it gone)."""
        with self._lock:
            future = self._waiting.pop(call_id, None)
        if future is None:
            return
        if error is None:
            future.set_result(value)
        else:
            future.set_exception(error)

    def recheck(self) -> None:
        """After the listener (re)connected: answers written meanwhile."""
        with self._lock:
            ids = list(self._waiting)
        for call_id in ids:
            self.answered(call_id)


class LeaderSide:
    """The leader's part: claim queued calls and make them (`handlers[kind](**args)`: a value, or a future of one)."""

    def __init__(self, store: Store, handlers: dict[str, Callable[..., object]]):
        self.store = store
        self.handlers = handlers

    def take(self) -> None:
        """Claim every queued call and make it; each answer is written when it is ready."""
        with self.store.engine.begin() as conn:
            claimed = conn.execute(text("UPDATE leader_calls SET status = 'running' WHERE status = 'queued' "
                                        "RETURNING id, kind, args")).all()
        for call_id, kind, args in claimed:
            try:
                answer = self.handlers[kind](**args)
            except Exception as e:
                self._answer(call_id, None, e)
                continue
            if isinstance(answer, concurrent.futures.Future):
                answer.add_done_callback(lambda f, call_id=call_id: self._answer(
                    call_id, None if f.exception() else f.result(), f.exception()))
            else:
                self._answer(call_id, answer, None)

    def _answer(self, call_id: str, value, error: BaseException | None) -> None:
        if error is not None and not isinstance(error, WhitneyError):
            log.error("leader call %s failed", call_id, exc_info=error)
        answer = {"value": value} if error is None else _error_dict(error)
        with self.store.engine.begin() as conn:
            conn.execute(text("UPDATE leader_calls SET status = :status, answer = :answer, finished_at = :now "
                              "WHERE id = :id AND status = 'running'"),
                         {"id": call_id, "status": "done" if error is None else "failed", "answer": json.dumps(answer),
                          "now": time.time()})
            send(conn, ENDED, CALL + call_id)


def fail_running(conn) -> None:
    """At a takeover: calls the former leader was making fail (Unavailable: the caller retries)."""
    rows = conn.execute(text("UPDATE leader_calls SET status = 'failed', answer = :answer, finished_at = :now "
                             "WHERE status = 'running' RETURNING id"),
                        {"answer": json.dumps(_error_dict(Unavailable("the scheduling leader stopped during this call; "
                                                                 "retry"))), "now": time.time()}).all()
    for (call_id,) in rows:
        send(conn, ENDED, CALL + call_id)


def _error_dict(error: BaseException) -> dict:
    if isinstance(error, WhitneyError):
        return {"class": type(error).__name__, "message": error.message, "field": error.field}
    return {"class": None, "message": f"{type(error).__name__}: {error}"}


def _error(answer: dict) -> BaseException:
    cls = getattr(errors, answer.get("class") or "", None)
    if isinstance(cls, type) and issubclass(cls, WhitneyError):
        return cls(answer["message"], field=answer.get("field"))
    return RuntimeError(answer.get("message", "the leader's call failed"))
