"""Events between the API processes of one database: PostgreSQL's LISTEN/NOTIFY.

A transaction that queues work or ends an operation also sends a notification on a channel (`send`, delivered
when it commits, never before); each process's `Listener` thread holds one connection listening on the channels
it was given and calls their handlers with each payload. A leader is woken by a submission, a follower's long-poll
by an operation's end, never by a timer. Notifications sent while a listener was reconnecting are not replayed:
its handlers' `on_connect` runs after every (re)connection, so they look at the database once then.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from sqlalchemy import text
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

SUBMITTED = "whitney_submitted"  # an operation queued (its id), or a leader call (call:<id>)
ENDED = "whitney_ended"  # an operation ended (its id), or a leader call answered (call:<id>)
RECONNECT_SECONDS = 1.0


def send(conn, channel: str, payload: str) -> None:
    """Notify `channel` with `payload` when the transaction of `conn` (a Connection or Session) commits."""
    conn.execute(text("SELECT pg_notify(:channel, :payload)"), {"channel": channel, "payload": payload})


class Listener:
    """One thread LISTENing on channels of the database: handlers[channel](payload) for each notification, and
    every `on_connect()` after each (re)connection (what was sent meanwhile is not replayed)."""

    def __init__(self, engine: Engine, handlers: dict[str, Callable[[str], None]],
                 on_connect: list[Callable[[], None]] | None = None):
        self._dsn = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._handlers = handlers
        self._on_connect = on_connect or []
        self._stop = threading.Event()
        self.connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="whitney-listen", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        import psycopg

        while not self._stop.is_set():
            try:
                with psycopg.connect(self._dsn, autocommit=True) as conn:
                    for channel in self._handlers:
                        conn.execute(f"LISTEN {channel}")
                    self.connected.set()
                    for hook in self._on_connect:
                        hook()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            self._dispatch(note.channel, note.payload)
            except Exception as e:  # the database went away: listen again once it is back
                self.connected.clear()
                if not self._stop.is_set():
                    log.warning("listening for the database's notifications failed (%s); again in %.0f s", e,
                                RECONNECT_SECONDS)
                    time.sleep(RECONNECT_SECONDS)

    def _dispatch(self, channel: str, payload: str) -> None:
        try:
            self._handlers[channel](payload)
        except Exception:
            log.exception("handling a notification on %s (%s) failed", channel, payload)
