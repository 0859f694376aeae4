"""Tinker's identity and session bookkeeping: the JWT exchange (whoami reads it), projects, session search,
session traces and the audit log, from what the store knows (sessions' labels, every operation's times).

Identity: a key's URN is `tml:user:whitney-key:{key id}` (the id `whitney keys list` shows; for a key given
to `whitney serve --api-key`, its owner digest; `tml:user:whitney-anonymous` on a server without keys), in
the organization `tml:organization:whitney`. A key sees only its own sessions, so "accessible" is its own.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from enum import StrEnum
from typing import Annotated, Any, Literal

from fastapi import Header, Request
from pydantic import Field

from whitney.errors import InvalidInput
from whitney.service.api.native.sessions import signed_trace_url
from whitney.service.api.tinker.common import TinkerBody, iso
from whitney.service.http import signing
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.store import projects
from whitney.service.store.keys import key_digest, presented_key
from whitney.service.store.lifecycle import OperationKind, SessionStatus
from whitney.service.store.records import KeyRecord

router = new_router()
ORG = "whitney"


def user_urn(st: ServiceState, who: str, credential: str | None) -> tuple[str, KeyRecord | None]:
    """The caller's URN and its key row (None for --api-key keys and no key)."""
    digest = key_digest(credential) if who else None
    row = st.store.find_key(digest) if digest else None
    if row is not None:
        return f"tml:user:whitney-key:{row.id}", row
    return (f"tml:user:whitney-key:{who}" if who else "tml:user:whitney-anonymous"), None


@router.post("/auth/token")
def auth_token(st: State, who: Owner, x_api_key: Annotated[str | None, Header()] = None,
               authorization: Annotated[str | None, Header()] = None) -> dict:
    """A JWT for the presented key (signing.py): the SDK sends it instead of the key from then on."""
    credential = presented_key(authorization, x_api_key)
    urn, row = user_urn(st, who, credential)
    return {"jwt": signing.mint_jwt({"sub": urn, "org_id": ORG, "email": "", "name": row.name if row else None,
                                     "key_digest": key_digest(credential) if who else None})}


class Project(TinkerBody):
    project_id: str | None = None


@router.put("/sessions/{session_id}/project")
def assign_project(session_id: str, body: Project, st: State, who: Owner) -> None:
    if not body.project_id:
        raise InvalidInput("project_id is required (a session cannot be moved out of a project)", field="project_id")
    projects.label(st.store, session_id, who, project_id=body.project_id)


class Cursor(TinkerBody):
    last_created_at: str
    last_session_id: str


class OwnerFilter(StrEnum):
    """Whose sessions a search finds (its `owner.type`)."""

    OWN = "own"  # the caller's
    ACCESSIBLE = "accessible"  # those the caller may read: its own here (keys share nothing)
    USER = "user"  # the caller's, when its URN is among `owner.owner_urns`; else none


class Search(TinkerBody):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = Field(None, min_length=1)
    owner: dict[str, Any] = {"type": OwnerFilter.OWN.value}
    statuses: list[dict[str, Any]] | None = Field(None, min_length=1)
    limit: int = Field(50, ge=1, le=200)
    cursor: Cursor | None = None


# Tinker's session statuses as Whitney's: a closed session is one whose client finished it (its reason is not
# recorded); Whitney cancels or fails runs, never sessions, so those match none.
STATUS_QUERY = {"active": [SessionStatus.ACTIVE], "client_finished": [SessionStatus.CLOSED], "cancelled": [],
                "failed": []}


@router.post("/sessions/search")
def search_sessions(body: Search, request: Request, st: State, who: Owner) -> dict:
    """The caller's sessions matching every filter, newest first, a page at a time."""
    urn, _ = user_urn(st, who, presented_key(request.headers.get("authorization"), request.headers.get("x-api-key")))
    kind = body.owner.get("type")
    if kind not in tuple(OwnerFilter):
        raise InvalidInput(f"owner type must be own, accessible or user, got {kind!r}", field="owner")
    statuses = None
    if body.statuses is not None:
        statuses = []
        for i, query in enumerate(body.statuses):
            if query.get("type") not in STATUS_QUERY:
                raise InvalidInput(f"status {i} must be one of {sorted(STATUS_QUERY)}", field="statuses")
            if query.get("reasons"):
                raise InvalidInput("finish reasons are not recorded here; leave reasons out", field="statuses")
            statuses += STATUS_QUERY[query["type"]]
    found = projects.find_sessions(st.store, who, project_ids=body.project_ids, display_name=body.display_name,
                                   session_id=body.session_id, user_metadata=body.user_metadata, statuses=statuses)
    if kind == OwnerFilter.USER and urn not in body.owner.get("owner_urns", []):
        found = []
    if body.cursor is not None:
        # compared as the datetimes the cursor was written from (microseconds), not as floats
        after = (cursor_time(body.cursor.last_created_at), body.cursor.last_session_id)
        found = [s for s in found if (datetime.fromtimestamp(s.created_at, timezone.utc), s.id) < after]
    page = found[:body.limit]
    counts = projects.checkpoint_counts(st.store, [s.id for s in page])
    last = page[-1] if len(found) > body.limit else None
    return {"sessions": [{
        "session_id": s.id, "created_at": iso(s.created_at), "owner": urn, "project_id": s.project_id or "",
        "status": {"type": "active"} if s.status == SessionStatus.ACTIVE else None,
        "checkpoints_count": counts[s.id], "display_name": s.display_name,
        "user_metadata": {k: str(v) for k, v in (s.user_metadata or {}).items()}} for s in page],
        "next_cursor": None if last is None else {"last_created_at": iso(last.created_at),
                                                  "last_session_id": last.id}}


def cursor_time(text: str) -> datetime:
    """A cursor's `last_created_at`: an ISO 8601 time (UTC when it names no zone); anything else is a 400."""
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise InvalidInput(f"cursor.last_created_at must be an ISO 8601 time, as next_cursor gives it, got {text!r}",
                           field="cursor.last_created_at") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)


@router.get("/sessions/{session_id}/trace_export")
def trace_export(session_id: str, request: Request, st: State, who: Owner) -> dict:
    """Ready at once: a signed URL (an hour) of the session's operations as a Chrome trace-event JSON document,
    which Perfetto opens (not Tinker's .pftrace protobuf)."""
    st.store.get_session(session_id, who)
    return {"status": "ready", "url": signed_trace_url(request, session_id)}


CHECKPOINT_KINDS = {OperationKind.SAVE_STATE, OperationKind.SAVE_WEIGHTS, OperationKind.EXPORT_LORA,
                    OperationKind.SAVE_WEIGHTS_FOR_SAMPLER, OperationKind.LOAD_STATE,
                    OperationKind.LOAD_STATE_WITH_OPTIMIZER}


@router.get("/audit")
def audit_log(st: State, who: Owner, day: date | None = None,
              event_type: Literal["all", "checkpoints", "projects", "teams", "organizations"] = "all") -> dict:
    """The caller's operations of one UTC day (default today), each as `operation_<kind>` with its status and
    times; "checkpoints" keeps the saves and loads. Whitney has no projects, teams or organizations to audit."""
    day = day or datetime.now(timezone.utc).date()
    start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc)
    ops = projects.owner_operations(st.store, who, start.timestamp(), (start + timedelta(days=1)).timestamp())
    if event_type != "all":
        ops = [op for op in ops if event_type == "checkpoints" and op.kind in CHECKPOINT_KINDS]
    return {"entries": [{
        "timestamp": iso(op.created_at), "event": f"operation_{op.kind}", "model_id": op.run_id,
        "event_details": {"operation_id": op.id, "run_id": op.run_id, "seq_id": op.seq_id,
                          "status": op.status, "started_at": iso(op.started_at),
                          "finished_at": iso(op.finished_at), "error": (op.error or {}).get("code")}}
        for op in ops]}
