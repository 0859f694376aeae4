"""The scheduling leader's lease in the database, and the fence that keeps a former leader from writing.

One row of `leases` (tables.LeaseRow) names the process that schedules, until `expires_at` on the database's clock
(never a process's: hosts' clocks differ). The holder renews it every third of its length; any other process takes
it once it has expired, and taking it raises `token` by one. The token is the fencing token: once a process leads,
every transaction of its store that writes first checks, in the same transaction, that the lease still carries its
token (`install_fence`), holding the row FOR SHARE on PostgreSQL so that a new leader's takeover waits for that
transaction to end. A leader stalled past its lease (SIGSTOP, a frozen VM, a long GC) and resumed after another
took over therefore changes nothing: its first write raises `Fenced`, and it steps down.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from sqlalchemy import event, text
from sqlalchemy.engine import Engine

log = logging.getLogger(__name__)

SCHEDULER = "scheduler"  # the one lease the service holds: the scheduling leader's
_WRITES = ("INSERT", "UPDATE", "DELETE")


class Fenced(RuntimeError):
    """This process's lease was taken by another: it no longer leads, and may not write."""


def _now(engine: Engine) -> str:
    """The database's clock in seconds since the epoch, as SQL."""
    if engine.dialect.name == "postgresql":
        return "EXTRACT(EPOCH FROM clock_timestamp())::double precision"
    return "((julianday('now') - 2440587.5) * 86400.0)"


def acquire(engine: Engine, holder: str, seconds: float, url: str | None = None, name: str = SCHEDULER) -> int | None:
    """Take the lease `name` for `seconds` if it is free (never held, or expired): its new token, else None."""
    now = _now(engine)
    with engine.begin() as conn:
        row = conn.execute(text(
            f"INSERT INTO leases (name, holder, token, expires_at, url) VALUES (:name, :holder, 1, {now} + :s, :url) "
            f"ON CONFLICT (name) DO UPDATE SET holder = :holder, token = leases.token + 1, expires_at = {now} + :s, "
            f"url = :url WHERE leases.expires_at < {now} RETURNING token"),
            {"name": name, "holder": holder, "s": seconds, "url": url}).first()
    return None if row is None else int(row[0])


def renew(engine: Engine, holder: str, token: int, seconds: float, url: str | None = None,
          name: str = SCHEDULER) -> bool:
    """Extend the lease by `seconds` from now while it still carries `token` (no other process took it, even if it
    expired meanwhile); False once it was taken."""
    with engine.begin() as conn:
        return conn.execute(text(
            f"UPDATE leases SET expires_at = {_now(engine)} + :s, url = COALESCE(:url, url) WHERE name = :name "
            "AND holder = :holder AND token = :token"),
            {"name": name, "holder": holder, "token": token, "s": seconds, "url": url}
        ).rowcount == 1


def release(engine: Engine, holder: str, token: int, name: str = SCHEDULER) -> None:
    """Give the lease up at once (a clean stop): the next process need not wait for it to expire."""
    with engine.begin() as conn:
        conn.execute(text(f"UPDATE leases SET expires_at = {_now(engine)} - 1 WHERE name = :name AND holder = :holder "
                          "AND token = :token"), {"name": name, "holder": holder, "token": token})


@dataclass(frozen=True)
class LeaseHolder:
    """Who holds the lease, as the database says (read by /healthz)."""

    holder: str
    token: int
    seconds_left: float
    url: str | None


def holder_of(engine: Engine, name: str = SCHEDULER) -> LeaseHolder | None:
    """The lease's holder, or None when it is free."""
    with engine.connect() as conn:
        row = conn.execute(text(f"SELECT holder, token, expires_at - {_now(engine)}, url FROM leases "
                                "WHERE name = :name"), {"name": name}).first()
    if row is None or row[2] < 0:
        return None
    return LeaseHolder(row[0], int(row[1]), float(row[2]), row[3])


def end_stalled_transactions(engine: Engine, seconds: float) -> None:
    """Have PostgreSQL end a session of `engine` that stays idle inside a transaction for `seconds` (at least 1):
    a process stalled in one (SIGSTOP between a statement and its commit) would otherwise hold its row locks, the
    lease's among them, and keep every other process from taking the lease. Connections made before are closed."""
    limit = max(1000, int(seconds * 1000))

    @event.listens_for(engine, "connect")
    def _limit(dbapi_connection, _record):
        autocommit, dbapi_connection.autocommit = dbapi_connection.autocommit, True
        with dbapi_connection.cursor() as cursor:
            cursor.execute(f"SET idle_in_transaction_session_timeout = {limit}")
        dbapi_connection.autocommit = autocommit

    engine.dispose()


@dataclass
class Fence:
    """The token this process's writes must still find in the lease (None: it does not lead, and nothing is
    checked: an API process's own writes, submissions and heartbeats, are any process's to make)."""

    holder: str
    token: int | None = None
    name: str = SCHEDULER


def install_fence(engine: Engine, fence: Fence, on_fenced) -> None:
    """Check `fence` before the first write of every transaction on `engine` (INSERT, UPDATE or DELETE), in that
    transaction: a lease that no longer carries the fence's token raises Fenced (the transaction changes nothing)
    after calling `on_fenced()` (the process steps down)."""
    postgres = engine.dialect.name == "postgresql"
    check = ("SELECT holder, token FROM leases WHERE name = %(name)s FOR SHARE" if postgres
             else "SELECT holder, token FROM leases WHERE name = :name")

    @event.listens_for(engine, "before_cursor_execute")
    def _check(conn, cursor, statement, parameters, context, executemany):
        if fence.token is None or conn.info.get("fence_checked"):
            return
        if not statement.lstrip().upper().startswith(_WRITES):
            return
        conn.info["fence_checked"] = True  # for this transaction (cleared as it ends)
        cursor.execute(check, {"name": fence.name})
        row = cursor.fetchone()
        if row is None or row[0] != fence.holder or int(row[1]) != fence.token:
            log.error("the scheduling lease was taken by another process (token %s, ours %s): stepping down",
                      None if row is None else row[1], fence.token)
            on_fenced()
            raise Fenced(f"lease {fence.name!r} no longer carries token {fence.token}")

    @event.listens_for(engine, "commit")
    @event.listens_for(engine, "rollback")
    def _ended(conn):
        conn.info.pop("fence_checked", None)
