"""Sessions' tags, project and display name; finding sessions by them; and what a session or a key did.

The labels are columns of the sessions table (migrated onto older databases by migrations.migrate). Owner,
project and status filter in SQL; tags, display-name words and user_metadata pairs are matched here, on the
owner's rows. The record of what happened is the operations table: each operation's kind, status,
timestamps (created, started, finished) and error code, which is what traces and audit logs show.
"""

from __future__ import annotations

from sqlalchemy import select, update

from whitney.errors import InvalidInput
from whitney.service.store.database import Store
from whitney.service.store.records import OperationRecord, SessionRecord, record
from whitney.service.store.tables import OperationRow, PackageRow, RunRow, SessionRow

MAX_TAGS = 64
MAX_LABEL = 256  # characters of a tag, project id or display name (the columns' width)


def check_labels(tags: list[str] | None = None, project_id: str | None = None,
                 display_name: str | None = None) -> None:
    if tags is not None:
        if len(tags) > MAX_TAGS:
            raise InvalidInput(f"at most {MAX_TAGS} tags, got {len(tags)}", field="tags")
        for i, tag in enumerate(tags):
            if not isinstance(tag, str) or not 1 <= len(tag) <= MAX_LABEL:
                raise InvalidInput(f"tag {i} must be a string of 1 to {MAX_LABEL} characters", field="tags")
    for name, value in (("project_id", project_id), ("display_name", display_name)):
        if value is not None and not 1 <= len(value) <= MAX_LABEL:
            raise InvalidInput(f"{name} must be 1 to {MAX_LABEL} characters", field=name)


def label(store: Store, session_id: str, who: str, **labels) -> SessionRecord:
    """Set any of tags, project_id, display_name on the caller's session (None leaves one as it is)."""
    given = {k: v for k, v in labels.items() if v is not None}
    unknown = set(given) - {"tags", "project_id", "display_name"}
    assert not unknown, unknown
    check_labels(**given)
    store.get_session(session_id, who)
    if given:
        with store.tx() as db:
            db.execute(update(SessionRow).where(SessionRow.id == session_id).values(**given))
    return store.get_session(session_id, who)


def find_sessions(store: Store, who: str, *, tags: list[str] = (), project_ids: list[str] | None = None,
                  display_name: str | None = None, session_id: str | None = None,
                  user_metadata: dict | None = None, statuses: list[str] | None = None) -> list[SessionRecord]:
    """The caller's sessions that match every filter given, newest first. tags: each must be held;
    display_name: every word appears in the name (case-insensitive); with session_id, a session matching
    either the id or the name matches (Tinker's search rule); user_metadata: each pair equal."""
    q = select(SessionRow).where(SessionRow.owner == who)
    if project_ids is not None:
        q = q.where(SessionRow.project_id.in_(project_ids))
    if statuses is not None:
        q = q.where(SessionRow.status.in_(statuses))
    with store.tx() as db:
        rows = [record(SessionRecord, r)
                for r in db.scalars(q.order_by(SessionRow.created_at.desc(), SessionRow.id.desc()))]
    words = display_name.lower().split() if display_name else []

    def named(s: SessionRecord) -> bool:
        by_name = bool(words) and all(w in (s.display_name or "").lower() for w in words)
        if session_id is not None:
            return s.id == session_id or by_name
        return by_name or not words

    return [s for s in rows if named(s) and set(tags) <= set(s.tags or [])
            and all((s.user_metadata or {}).get(k) == v for k, v in (user_metadata or {}).items())]


def checkpoint_counts(store: Store, session_ids: list[str]) -> dict[str, int]:
    """Live packages per session (through their runs)."""
    with store.tx() as db:
        rows = db.execute(select(RunRow.session_id, PackageRow.id).join(PackageRow, PackageRow.run_id == RunRow.id)
                          .where(RunRow.session_id.in_(session_ids), PackageRow.deleted.is_(False))).all()
    counts = dict.fromkeys(session_ids, 0)
    for sid, _ in rows:
        counts[sid] += 1
    return counts


def session_owner(store: Store, session_id: str) -> str:
    """Who owns a session ('' when it does not exist: then get_session(id, '') is a 404 as usual)."""
    with store.tx() as db:
        return db.scalar(select(SessionRow.owner).where(SessionRow.id == session_id)) or ""


def session_operations(store: Store, session_id: str, who: str) -> list[OperationRecord]:
    """Every operation of the session's runs, in the order they were made."""
    store.get_session(session_id, who)
    with store.tx() as db:
        q = (select(OperationRow).join(RunRow, OperationRow.run_id == RunRow.id)
             .where(RunRow.session_id == session_id).order_by(OperationRow.created_at))
        return [record(OperationRecord, r) for r in db.scalars(q)]


def owner_operations(store: Store, who: str, since: float, until: float) -> list[OperationRecord]:
    """Every operation of the key made in [since, until), sampling ones included, oldest first."""
    with store.tx() as db:
        q = select(OperationRow).where(OperationRow.owner == who, OperationRow.created_at >= since,
                                       OperationRow.created_at < until).order_by(OperationRow.created_at)
        return [record(OperationRecord, r) for r in db.scalars(q)]


def trace_events(session: SessionRecord, operations: list[OperationRecord]) -> dict:
    """A session's operations as a Chrome trace-event document (Perfetto and chrome://tracing open it): one
    track per run, a complete event per operation from its start (or creation) to its end, microseconds."""
    events = []
    for op in operations:
        begin = op.started_at or op.created_at
        end = op.finished_at or begin
        events.append({"name": op.kind, "ph": "X", "pid": 1, "tid": op.run_id or "sampling",
                       "ts": round(begin * 1e6), "dur": round((end - begin) * 1e6),
                       "args": {"operation_id": op.id, "seq_id": op.seq_id, "status": op.status,
                                "queued_at": op.created_at, "error": (op.error or {}).get("code")}})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"session_id": session.id, "display_name": session.display_name}}

