"""The durable store: sessions, runs, operations and model packages in SQL (SQLite by default).

The database is the truth a client sees: every poll is answered from it, so after a restart the
server still answers truthfully. The rules that must survive races are constraints:
  - (run_id, seq_id) is unique: a resubmitted operation resolves to the existing row (safe retries);
  - (run_id, kind, name, version) is unique for model packages: versions never collide;
  - a status moves only as whitney.service.store.lifecycle lists, each move one conditional UPDATE;
  - a quota's count and the session, run or operation it admits are one transaction under the owner's lock
    (quota_tx), so concurrent requests, in one process or several, never pass a limit together.
Methods return typed records (records.py); routes and the scheduler never see rows.
"""

from __future__ import annotations

import hashlib
import json
import time
from contextlib import contextmanager
from typing import Callable

from sqlalchemy import bindparam, create_engine, delete, event, exists, func, insert, or_, select, text, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from whitney.errors import Conflict, NotFound
from whitney.protocol.backend import PackageKind
from whitney.service.store.json_values import loads as read_json
from whitney.service.store.lifecycle import (OPERATION_MOVES, OPERATION_PENDING, OPERATION_TERMINAL, RUN_LIVE,
                                             RUN_MOVES, RUN_OPEN, SESSION_MOVES, FailureCategory, OperationKind,
                                             OperationStatus, RunStatus, SessionStatus, sources)
from whitney.service.store.migrations import migrate
from whitney.service.store.records import (KeyRecord, OperationRecord, PackageRecord, RunRecord, SessionRecord,
                                           record)
from whitney.service.store.tables import Base, KeyRow, OperationRow, PackageRow, RunRow, SessionRow, new_id


class Store:
    """Owns the database connection. Every method is one short transaction."""

    def __init__(self, url: str, observer: Callable[..., None] | None = None):
        """`observer(kind, status, created_at, started_at, finished_at, result, error)` hears of every
        operation that ends (the metrics)."""
        self.observer = observer
        args = {"check_same_thread": False, "timeout": 30} if url.startswith("sqlite") else {}
        # JSON columns are read with read_json: a row stored with a lone surrogate reads back as U+FFFD, one nested
        # too deep to serialise is cut (json_values.py): no stored row breaks a read.
        self.engine = create_engine(url, connect_args=args, json_deserializer=read_json)
        if url.startswith("sqlite"):
            @event.listens_for(self.engine, "connect")
            def _pragmas(conn, _):  # WAL: pollers read while the scheduler writes
                conn.execute("PRAGMA journal_mode=WAL")
                conn.execute("PRAGMA foreign_keys=ON")
        Base.metadata.create_all(self.engine)
        migrate(self.engine)
        self._session = sessionmaker(self.engine, expire_on_commit=False)
        self.at_end: dict[str, Callable] = {}  # op id -> fn(status, result) -> result, run as it ends (packages.py)
        # Set by a highly available service (service/cluster/wiring.py): `queued(conn, op_id, payload)` in the
        # transaction that queues an operation, `ended(conn, op_ids)` in the one that ends operations.
        self.queued: Callable[[object, str, bytes | None], None] | None = None
        self.ended: Callable[[object, list[str]], None] | None = None

    @contextmanager
    def tx(self):
        with self._session() as db, db.begin():
            yield db

    @contextmanager
    def quota_tx(self, owner: str):
        """A Core transaction holding `owner`'s quota lock, so that what a quota counts and the row it admits are
        one atomic step, across threads and across API processes on one database: SQLite, BEGIN IMMEDIATE (the
        database's one writer, taken before the counts are read); PostgreSQL, a transaction-scoped advisory lock
        on the owner. Every read inside must use the yielded connection (another from the pool could wait on
        this one's lock)."""
        with self.engine.connect() as conn:
            if self.engine.dialect.name == "sqlite":
                conn.exec_driver_sql("BEGIN IMMEDIATE")  # the driver then starts no transaction of its own
            self.lock_owner(conn, owner)
            try:
                yield conn
            except BaseException:
                conn.rollback()
                raise
            conn.commit()

    def lock_owner(self, conn, owner: str) -> None:
        """Take `owner`'s quota lock in the transaction of `conn` (a Connection or an ORM Session) until it ends:
        PostgreSQL's advisory lock; on SQLite the transaction's first write serialises writers already."""
        if self.engine.dialect.name == "postgresql":
            conn.execute(_OWNER_LOCK, {"key": _lock_key(owner)})

    @contextmanager
    def _reading(self, conn=None):
        """`conn` (one a quota_tx holds), or a connection of the pool's for this read alone."""
        if conn is not None:
            yield conn
        else:
            with self.engine.connect() as own:
                yield own

    # ---- sessions ---------------------------------------------------------------------------

    def create_session(self, owner: str, user_metadata: dict | None = None,
                       admit: Callable[[object], None] | None = None) -> SessionRecord:
        """A new active session. `admit(conn)` (the quota check) runs in the transaction that inserts it, under
        the owner's quota lock (quota_tx): raising refuses it and nothing is stored."""
        now = time.time()
        row = {"id": new_id("ses"), "owner": owner, "status": SessionStatus.ACTIVE, "created_at": now,
               "last_heartbeat": now, "user_metadata": user_metadata or {}, "tags": None, "project_id": None,
               "display_name": None}
        with self.quota_tx(owner) as conn:
            if admit is not None:
                admit(conn)
            conn.execute(insert(SessionRow), [row])
        return SessionRecord(**row)

    def get_session(self, session_id: str, owner: str) -> SessionRecord:
        with self.tx() as db:
            row = db.get(SessionRow, session_id)
            if row is None or row.owner != owner:
                raise NotFound(f"session {session_id!r} does not exist", field="session_id")
            return record(SessionRecord, row)

    def list_sessions(self, owner: str) -> list[SessionRecord]:
        with self.tx() as db:
            rows = db.scalars(select(SessionRow).where(SessionRow.owner == owner).order_by(SessionRow.created_at))
            return [record(SessionRecord, r) for r in rows]

    def heartbeat(self, session_id: str, owner: str) -> SessionRecord:
        with self.tx() as db:
            row = db.get(SessionRow, session_id)
            if row is None or row.owner != owner:
                raise NotFound(f"session {session_id!r} does not exist", field="session_id")
            if row.status != SessionStatus.ACTIVE:
                raise Conflict(f"session {session_id!r} is {row.status}", field="session_id")
            row.last_heartbeat = time.time()
            return record(SessionRecord, row)

    def end_session(self, session_id: str, status: SessionStatus) -> bool:
        """Close or expire a session (SESSION_MOVES: only an active one); True if it moved."""
        status = SessionStatus(status)
        with self.tx() as db:
            return db.execute(update(SessionRow).where(SessionRow.id == session_id,
                                                       SessionRow.status.in_(sources(SESSION_MOVES, status)))
                              .values(status=status)).rowcount == 1

    def idle_sessions(self, older_than: float) -> list[str]:
        with self.tx() as db:
            rows = db.scalars(select(SessionRow.id).where(SessionRow.status == SessionStatus.ACTIVE,
                                                          SessionRow.last_heartbeat < older_than))
            return list(rows)

    # ---- runs -------------------------------------------------------------------------------

    def create_run(self, session_id: str, owner: str, base_model: str, lora: dict, resume_from: str | None,
                   resume_with_optimizer: bool, user_metadata: dict | None, run_id: str | None = None,
                   admit: Callable[[object], None] | None = None) -> RunRecord:
        """A new active run of the owner's active session. `admit(conn)` (the quota check) runs in the
        transaction that inserts it, under the owner's quota lock (quota_tx): raising refuses it, nothing stored."""
        row = {"id": run_id or new_id("run"), "session_id": session_id, "owner": owner, "base_model": base_model,
               "lora": lora, "status": RunStatus.ACTIVE, "created_at": time.time(), "resume_from": resume_from,
               "resume_with_optimizer": resume_with_optimizer, "user_metadata": user_metadata or {}, "error": None}
        with self.quota_tx(owner) as conn:
            session = conn.execute(select(SessionRow.owner, SessionRow.status).where(
                SessionRow.id == session_id)).first()
            if session is None or session.owner != owner:
                raise NotFound(f"session {session_id!r} does not exist", field="session_id")
            if session.status != SessionStatus.ACTIVE:
                raise Conflict(f"session {session_id!r} is {session.status}", field="session_id")
            if admit is not None:
                admit(conn)
            conn.execute(insert(RunRow), [row])
        return RunRecord(**row)

    def drop_run(self, run_id: str) -> None:
        """Remove a run recorded (and so counted against its key's quotas) before its backend opened it, when the
        backend refused to: as if it was never made. One that already has operations is marked failed instead."""
        try:
            with self.tx() as db:
                db.execute(delete(RunRow).where(RunRow.id == run_id))
        except IntegrityError:
            self.set_run_status(run_id, RunStatus.FAILED, "the backend could not open this run")

    def get_run(self, run_id: str, owner: str | None = None) -> RunRecord:
        with self.engine.connect() as conn:  # Core: every training request reads its run
            row = conn.execute(_RUN, {"id": run_id}).first()
        if row is None or (owner is not None and row.owner != owner):
            raise NotFound(f"run {run_id!r} does not exist", field="run_id")
        return record(RunRecord, row)

    def list_runs(self, owner: str, session_id: str | None = None) -> list[RunRecord]:
        with self.tx() as db:
            q = select(RunRow).where(RunRow.owner == owner)
            if session_id is not None:
                q = q.where(RunRow.session_id == session_id)
            return [record(RunRecord, r) for r in db.scalars(q.order_by(RunRow.created_at))]

    def runs_of_session(self, session_id: str) -> list[RunRecord]:
        with self.tx() as db:
            return [record(RunRecord, r) for r in db.scalars(select(RunRow).where(RunRow.session_id == session_id))]

    def set_run_status(self, run_id: str, status: RunStatus, error: str | None = None) -> bool:
        """Move a run to `status` if lifecycle.RUN_MOVES allows it from the run's status now; True if it moved.

        False (nothing changes) is a race lost, not an error: the run ended, or began to, first. The check
        and the move are one conditional UPDATE, so two racing moves never both succeed."""
        status = RunStatus(status)  # a ValueError for a name that is no run status: a bug
        values = {"status": status} if error is None else {"status": status, "error": error}
        with self.tx() as db:
            return db.execute(update(RunRow).where(RunRow.id == run_id, RunRow.status.in_(sources(RUN_MOVES, status)))
                              .values(**values)).rowcount == 1

    # ---- operations -------------------------------------------------------------------------

    def submit_operation(self, owner: str, run_id: str | None, seq_id: int | None, kind: OperationKind,
                         body_digest: str, admit: Callable[[object], None] | None = None,
                         config: dict | None = None, payload: bytes | None = None) -> tuple[OperationRecord, bool]:
        """Queue (run, seq_id), or return the existing operation if the same body was sent before.

        Returns (operation, created). The run must be the owner's (NotFound). A run that is not active
        takes no new seq_id (Conflict) but still answers a retry of one it has; a different body under a
        used seq_id is a Conflict. `admit(conn)` (the quota check) runs only for a new operation, in the
        transaction that inserts it, under the owner's quota lock (quota_tx: the count and the insert are one
        step, so concurrent submissions never pass a limit together); raising refuses it and nothing is
        stored. Sampling operations pass run_id/seq_id None
        and are never deduplicated. `config` is kept beside a new operation (what the console's configuration
        panel shows: a forward's loss, an optim_step's hyperparameters); a retry keeps the first one's. `payload`:
        its job, stored with it where several processes share the database (`queued`).

        `admit` reads the store only through the connection it is given (another from the pool could wait on
        this one's lock). The unique (run, seq_id) constraint is what makes a racing retry safe.
        """
        row = {"id": new_id("op"), "owner": owner, "run_id": run_id, "seq_id": seq_id, "kind": OperationKind(kind),
               "body_digest": body_digest, "status": OperationStatus.QUEUED, "result": None, "error": None,
               "created_at": time.time(), "started_at": None, "finished_at": None, "config": config}
        if run_id is not None:  # Core statements throughout: every operation passes here
            with self.engine.connect() as conn:
                run = conn.execute(_RUN, {"id": run_id}).first()
                if run is None or run.owner != owner:
                    raise NotFound(f"run {run_id!r} does not exist", field="run_id")
                existing = self._same_operation(conn, run_id, seq_id, kind, body_digest)
                if existing is not None:
                    return existing, False
                if run.status != RunStatus.ACTIVE:
                    raise Conflict(f"run {run_id!r} is {run.status}; it takes no more operations", field="run_id")
        try:
            if admit is None:
                with self.engine.begin() as conn:
                    conn.execute(_INSERT_OPERATION, [row])
                    self._queued(conn, row["id"], payload)
            else:
                with self.quota_tx(owner) as conn:
                    admit(conn)
                    conn.execute(_INSERT_OPERATION, [row])
                    self._queued(conn, row["id"], payload)
            return OperationRecord(**row), True
        except IntegrityError:  # the same (run, seq_id) committed by a racing request
            with self.engine.connect() as conn:
                existing = self._same_operation(conn, run_id, seq_id, kind, body_digest)
            if existing is None:
                raise
            return existing, False

    @staticmethod
    def _same_operation(conn, run_id: str, seq_id: int, kind: str, body_digest: str) -> OperationRecord | None:
        """The operation at (run, seq_id), if any, when it is the same request; a Conflict when it is not."""
        existing = conn.execute(_OPERATION_AT, {"run_id": run_id, "seq_id": seq_id}).first()
        if existing is None:
            return None
        if existing.body_digest != body_digest or existing.kind != kind:
            raise Conflict(f"seq_id {seq_id} of run {run_id!r} was already used for a different "
                           f"{existing.kind} request", field="seq_id")
        return record(OperationRecord, existing)

    def get_operation(self, op_id: str, owner: str | None = None) -> OperationRecord:
        """The operation's row (a Core read: every long-poll asks, so none of the ORM's loading)."""
        with self.engine.connect() as conn:
            row = conn.execute(_OPERATION, {"id": op_id}).first()
        if row is None or (owner is not None and row.owner != owner):
            raise NotFound(f"operation {op_id!r} does not exist", field="operation_id")
        return record(OperationRecord, row)

    def find_operation(self, run_id: str, seq_id: int) -> OperationRecord | None:
        with self.tx() as db:
            row = db.scalars(select(OperationRow).where(OperationRow.run_id == run_id,
                                                        OperationRow.seq_id == seq_id)).first()
            return record(OperationRecord, row) if row is not None else None

    def list_operations(self, run_id: str) -> list[OperationRecord]:
        with self.tx() as db:
            q = select(OperationRow).where(OperationRow.run_id == run_id).order_by(OperationRow.seq_id)
            return [record(OperationRecord, r) for r in db.scalars(q)]

    def set_operation(self, op_id: str, status: OperationStatus, result: dict | None = None,
                      error: dict | None = None) -> bool:
        """Move an operation as lifecycle.OPERATION_MOVES allows (one conditional UPDATE); True if it moved.

        False changes nothing: an operation that ended (cancelled with its run) never starts or ends again."""
        return self.set_operations([(op_id, status, result, error)])[0]

    def set_operations(self, moves: list[tuple[str, OperationStatus, dict | None, dict | None]],
                       ended_at: list[float | None] | None = None) -> list[bool]:
        """`set_operation` for each (op_id, status, result, error), all in one transaction (the scheduler's
        batch of starts or ends: one commit, not one per operation); whether each moved. `ended_at`: each
        end's time.time() where it ended before this write (the scheduler holds some ends for one commit);
        None: now."""
        now, rows, ended = time.time(), [], []
        for (op_id, status, result, error), at in zip(moves, ended_at or [None] * len(moves)):
            status = OperationStatus(status)
            if status in OPERATION_TERMINAL and op_id in self.at_end:
                result = self.at_end.pop(op_id)(status, result)
            values: dict = {"op_id": op_id}  # _MOVE[status]'s parameters (the starts: one statement below)
            if status in OPERATION_TERMINAL:
                values.update(finished_at=now if at is None else at, result=result, error=error)
            rows.append((op_id, status, result, error, values))
        starts = [op_id for op_id, status, *_ in rows if status == OperationStatus.RUNNING]
        with self.engine.begin() as conn:  # Core statements: none of the ORM's per-row bookkeeping
            started = {r.id: r for r in conn.execute(_START, {"ids": starts, "started_at": now})} if starts else {}
            for op_id, status, result, error, values in rows:
                ended.append(started.get(op_id) if status == OperationStatus.RUNNING else conn.execute(
                    _MOVE[status], values).first())
            self._ended(conn, [op_id for (op_id, status, *_), row in zip(rows, ended)
                               if row is not None and status in OPERATION_TERMINAL])
        for (_, status, result, error, values), row in zip(rows, ended):
            if row is not None and status in OPERATION_TERMINAL:
                self._observe(row.kind, status, row.created_at, row.started_at, values["finished_at"], result, error)
        return [row is not None for row in ended]

    def _queued(self, conn, op_id: str, payload: bytes | None) -> None:
        if self.queued is not None:
            self.queued(conn, op_id, payload)

    def _ended(self, conn, op_ids: list[str]) -> None:
        if self.ended is not None and op_ids:
            self.ended(conn, op_ids)

    def _observe(self, *ended) -> None:
        if self.observer is not None:
            self.observer(*ended)

    def cancel_queued(self, run_id: str, reason: str) -> list[str]:
        """Cancel every queued operation of a run; return their ids."""
        return self.end_queued(run_id, OperationStatus.CANCELLED, {"code": "cancelled", "message": reason})

    def end_queued(self, run_id: str, status: OperationStatus, error: dict) -> list[str]:
        """End every queued operation of a run (cancelled, or failed) with `error`; return their ids."""
        with self.tx() as db:
            rows = list(db.scalars(select(OperationRow).where(OperationRow.run_id == run_id,
                                                              OperationRow.status == OperationStatus.QUEUED)))
            for row in rows:
                row.status, row.finished_at, row.error = status, time.time(), error
            self._ended(db, [row.id for row in rows])
        for row in rows:
            self.at_end.pop(row.id, lambda *_: None)(status, None)
            self._observe(row.kind, status, row.created_at, None, row.finished_at, None, error)
        return [r.id for r in rows]

    def status_counts(self) -> dict[str, dict[str, int]]:
        """How many runs and sessions have each status."""
        with self.tx() as db:
            runs = db.execute(select(RunRow.status, func.count()).group_by(RunRow.status)).all()
            sessions = db.execute(select(SessionRow.status, func.count()).group_by(SessionRow.status)).all()
        return {"runs": dict(runs), "sessions": dict(sessions)}

    def live_runs(self) -> list[RunRecord]:
        """Every run not yet ended (their adapters are held)."""
        with self.tx() as db:
            return [record(RunRecord, r) for r in db.scalars(select(RunRow).where(RunRow.status.in_(RUN_LIVE)))]

    def recover_after_restart(self) -> None:
        """Operations that were queued or running when the process died failed; their runs are interrupted."""
        with self.tx() as db:
            for row in db.scalars(select(OperationRow).where(OperationRow.status.in_(OPERATION_PENDING))):
                row.status, row.finished_at = OperationStatus.FAILED, time.time()
                row.error = {"code": "server_restarted", "message": "server restarted before this operation ran",
                             "category": FailureCategory.SERVER}
            for row in db.scalars(select(RunRow).where(RunRow.status.in_(sources(RUN_MOVES, RunStatus.INTERRUPTED)))):
                row.status = RunStatus.INTERRUPTED
                row.error = "server restarted; resume from the newest checkpoint with a new run"
            db.execute(update(PackageRow).where(PackageRow.readers != 0).values(readers=0))  # no load survives

    # ---- model packages ---------------------------------------------------------------------

    def register_package(self, run_id: str, owner: str, kind: PackageKind, name: str, path: str, base_model: str,
                         has_optimizer: bool = False, package_id: str | None = None) -> PackageRecord:
        kind = PackageKind(kind).value  # stored as its name (a ValueError for a kind that is none: a bug)
        with self.tx() as db:
            latest = db.scalars(select(PackageRow.version).where(
                PackageRow.run_id == run_id, PackageRow.kind == kind, PackageRow.name == name
            ).order_by(PackageRow.version.desc())).first()
            row = PackageRow(id=package_id or new_id("pkg"), run_id=run_id, owner=owner, kind=kind, name=name,
                             version=(latest or 0) + 1, path=path, base_model=base_model,
                             has_optimizer=has_optimizer, created_at=time.time())
            db.add(row)
        return record(PackageRecord, row)

    def get_package(self, package_id: str, owner: str | None = None) -> PackageRecord:
        with self.tx() as db:
            row = db.get(PackageRow, package_id)  # the owner's, or public; never one past its expiry
            if row is None or row.deleted or (owner is not None and row.owner != owner and not row.public) or (
                    row.expires_at is not None and row.expires_at <= time.time()):
                raise NotFound(f"model package {package_id!r} does not exist", field="checkpoint_id")
            return record(PackageRecord, row)

    def list_packages(self, owner: str, run_id: str | None = None, kind: str | None = None) -> list[PackageRecord]:
        with self.tx() as db:
            q = select(PackageRow).where(PackageRow.owner == owner, PackageRow.deleted.is_(False), or_(
                PackageRow.expires_at.is_(None), PackageRow.expires_at > time.time()))
            if run_id is not None:
                q = q.where(PackageRow.run_id == run_id)
            if kind is not None:
                q = q.where(PackageRow.kind == kind)
            return [record(PackageRecord, r) for r in db.scalars(q.order_by(PackageRow.created_at))]

    def sampler_version(self, run_id: str, version: int) -> PackageRecord | None:
        """The package that run's save_weights_for_sampler wrote for `version` (deleted ones included:
        a live run still holds the version in memory), or None if the run has no such version."""
        with self.tx() as db:
            ops = db.scalars(select(OperationRow).where(OperationRow.run_id == run_id,
                                                        OperationRow.kind == OperationKind.SAVE_WEIGHTS_FOR_SAMPLER,
                                                        OperationRow.status == OperationStatus.SUCCEEDED))
            for op in ops:
                if (op.result or {}).get("version") == version:
                    row = db.get(PackageRow, op.result["package"]["id"])
                    return record(PackageRecord, row) if row is not None else None
        return None

    def newest_sampler_versions(self, owner: str, limit: int) -> list[dict]:
        """The owner's newest `limit` sampler versions that `<run_id>@<version>` still samples (the run is open, or
        the version's package is not deleted: routes/sampling.py `resolve`), newest first: `{run_id, version,
        created}`, for GET /v1/models. One query; only the small parts of each result are read (JSON paths, as
        console/queries.py)."""
        package_id = OperationRow.result["package"]["id"].as_string()
        q = (select(OperationRow.run_id, OperationRow.result["version"].as_integer(), OperationRow.finished_at)
             .join(RunRow, RunRow.id == OperationRow.run_id)
             .outerjoin(PackageRow, PackageRow.id == package_id)
             .where(OperationRow.owner == owner, OperationRow.status == OperationStatus.SUCCEEDED,
                    OperationRow.kind == OperationKind.SAVE_WEIGHTS_FOR_SAMPLER,
                    or_(RunRow.status.in_(RUN_OPEN), PackageRow.deleted.is_(False)))
             .order_by(OperationRow.finished_at.desc(), OperationRow.id.desc()).limit(limit))
        with self.tx() as db:
            rows = db.execute(q).all()
        return [{"run_id": run_id, "version": version, "created": int(t or 0)} for run_id, version, t in rows
                if version is not None]


    def newest_checkpoints(self, owner: str, limit: int) -> list[dict]:
        """The owner's newest `limit` saved states and sampler versions that a checkpoint id reads (not deleted,
        not expired: Store.get_package), newest first: `{id, run_id, created}`."""
        q = (select(PackageRow.id, PackageRow.run_id, PackageRow.created_at)
             .where(PackageRow.owner == owner, PackageRow.kind.in_((PackageKind.STATE, PackageKind.SAMPLER)),
                    PackageRow.deleted.is_(False),
                    or_(PackageRow.expires_at.is_(None), PackageRow.expires_at > time.time()))
             .order_by(PackageRow.created_at.desc(), PackageRow.id.desc()).limit(limit))
        with self.tx() as db:
            rows = db.execute(q).all()
        return [{"id": package_id, "run_id": run_id, "created": int(t)} for package_id, run_id, t in rows]

    def delete_package(self, package_id: str, owner: str) -> PackageRecord:
        with self.tx() as db:
            row = db.get(PackageRow, package_id)
            if row is None or row.deleted or row.owner != owner:
                raise NotFound(f"model package {package_id!r} does not exist", field="checkpoint_id")
            row.deleted = True
            return record(PackageRecord, row)

    # ---- API keys and what each owner holds ---------------------------------------------------

    def create_key(self, digest: str, name: str | None, limits: dict) -> KeyRecord:
        row = KeyRow(id=new_id("key"), digest=digest, name=name, created_at=time.time(), **limits)
        with self.tx() as db:
            db.add(row)
        return record(KeyRecord, row)

    def list_keys(self) -> list[KeyRecord]:
        with self.tx() as db:
            return [record(KeyRecord, r) for r in db.scalars(select(KeyRow).order_by(KeyRow.created_at))]

    def find_key(self, digest: str) -> KeyRecord | None:
        """The key with this digest, revoked or not."""
        with self.tx() as db:
            row = db.scalars(select(KeyRow).where(KeyRow.digest == digest)).first()
            return record(KeyRecord, row) if row is not None else None

    def has_keys(self) -> bool:
        """Whether any key was ever created (a revoked one too: revoking the last key never opens the server)."""
        with self.tx() as db:
            return db.scalars(select(KeyRow.id).limit(1)).first() is not None

    def revoke_key(self, key_id: str) -> KeyRecord:
        """Revoke a key (again: no change, the first revocation time stays)."""
        with self.tx() as db:
            row = db.get(KeyRow, key_id)
            if row is None:
                raise NotFound(f"key {key_id!r} does not exist", field="key_id")
            row.revoked_at = row.revoked_at or time.time()
            return record(KeyRecord, row)

    def usage(self, owner: str) -> dict:
        """What an owner holds now: active sessions, live runs (base model and LoRA config each) and
        operations queued or running. Closed, expired, finished, cancelled or failed ones hold nothing."""
        with self._reading() as conn:
            return {"sessions": self.held_sessions(owner, conn), "runs": self.held_runs(owner, conn),
                    "operations": conn.execute(_PENDING, {"owner": owner}).scalar_one()}

    def held_sessions(self, owner: str, conn=None) -> int:
        """The owner's active sessions (read through `conn` where given: a quota_tx's)."""
        with self._reading(conn) as c:
            return c.execute(_SESSIONS_HELD, {"owner": owner}).scalar_one()

    def held_runs(self, owner: str, conn=None) -> list[tuple[str, dict]]:
        """(base model, LoRA config) of each of the owner's live runs (read through `conn` where given)."""
        with self._reading(conn) as c:
            return [(b, lora) for b, lora in c.execute(_RUNS_HELD, {"owner": owner})]

    def pending_operations(self, owner: str) -> int:
        """How many of an owner's operations are queued or running (usage's "operations", alone)."""
        with self.engine.connect() as conn:
            return conn.execute(_PENDING, {"owner": owner}).scalar_one()

    def pending_before(self, owner: str, run_id: str | None, seq_id: int | None, conn=None) -> int | None:
        """The owner's operations queued or running, for a new operation's queue limit; None when a later
        seq_id of its run is queued already (it waits for this one, so this one is never held back). One
        statement on the (owner, status) and (run_id, seq_id) indexes: every submission asks (through `conn`,
        its quota_tx's, where given)."""
        with self._reading(conn) as c:
            held, waited_for = c.execute(_PENDING_BEFORE, {"owner": owner, "run_id": run_id, "seq_id": seq_id}).one()
        return None if waited_for else held


# The statements every operation passes through, built once: SQLAlchemy then computes each one's cache key once,
# not per call (a third of a read's time).
_RUN = select(RunRow.__table__).where(RunRow.id == bindparam("id"))
_OPERATION = select(OperationRow.__table__).where(OperationRow.id == bindparam("id"))
_OPERATION_AT = select(OperationRow.__table__).where(OperationRow.run_id == bindparam("run_id"),
                                                     OperationRow.seq_id == bindparam("seq_id"))
_INSERT_OPERATION = insert(OperationRow)
_ENDED = (OperationRow.id, OperationRow.kind, OperationRow.created_at, OperationRow.started_at)
# The starts of a batch, in one statement; a move to each other status, from where it may come.
_START = update(OperationRow).where(
    OperationRow.id.in_(bindparam("ids", expanding=True)),
    OperationRow.status.in_(sources(OPERATION_MOVES, OperationStatus.RUNNING))).values(
    status=OperationStatus.RUNNING, started_at=bindparam("started_at")).returning(*_ENDED)
_MOVE = {status: update(OperationRow).where(
    OperationRow.id == bindparam("op_id"), OperationRow.status.in_(sources(OPERATION_MOVES, status))).values(
    status=status, **({"finished_at": bindparam("finished_at"), "result": bindparam("result"),
                       "error": bindparam("error")} if status in OPERATION_TERMINAL else {})).returning(*_ENDED)
    for status in OperationStatus if status != OperationStatus.RUNNING}
_PENDING = select(func.count()).select_from(OperationRow).where(OperationRow.owner == bindparam("owner"),
                                                                OperationRow.status.in_(OPERATION_PENDING))
_SESSIONS_HELD = select(func.count()).select_from(SessionRow).where(SessionRow.owner == bindparam("owner"),
                                                                     SessionRow.status == SessionStatus.ACTIVE)
_RUNS_HELD = select(RunRow.base_model, RunRow.lora).where(RunRow.owner == bindparam("owner"),
                                                          RunRow.status.in_(RUN_LIVE))
# PostgreSQL: one owner's quota checks and the inserts they admit, one at a time (Store.quota_tx), in every process.
_OWNER_LOCK = text("SELECT pg_advisory_xact_lock(:key)")


def _lock_key(owner: str) -> int:
    """The owner's advisory lock: a signed 64-bit number from its name."""
    return int.from_bytes(hashlib.sha256(b"whitney-quota:" + owner.encode()).digest()[:8], "big", signed=True)


_PENDING_BEFORE = select(_PENDING.scalar_subquery(), exists().where(  # a run_id of None (sampling) matches none
    OperationRow.run_id == bindparam("run_id"), OperationRow.seq_id > bindparam("seq_id"),
    OperationRow.status == OperationStatus.QUEUED))


def digest(body: dict) -> str:
    """A stable digest of a request body, for idempotent retries."""
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

