"""Tinker's client setup and session life: client/config, create_session, heartbeats, telemetry, finish."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from whitney.errors import Conflict
from whitney.service.api.native import schemas
from whitney.service.api.tinker.common import Tinker, TinkerBody
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.scheduling.limits import check_metadata
from whitney.service.store import projects
from whitney.service.store.lifecycle import RunStatus, SessionStatus
from whitney.service.store.records import SessionRecord

router = new_router()


@router.post("/client/config")
def client_config() -> dict:
    """Feature flags: the SDK's defaults suit us (JSON sampling polls, no zstd), but for JWT auth (the SDK
    exchanges its key for a JWT of this server, POST /auth/token, which carries the key's identity for
    `whoami`) and server-side custom losses (create_custom_loss uploads the traced graph: custom_loss.py)."""
    return {"pjwt_auth_enabled": True, "custom_loss_server_side": True}


@router.post("/client/dynamic_config")
def client_dynamic_config() -> dict:
    """The SDK sends cancel_future for a sampling future it abandons (a timeout, a cancelled task): the sample
    stops at once rather than decoding for nobody."""
    return {"sample_cancel_enabled": True}


@router.get("/healthz")
def healthz() -> dict:
    return {"status": "ok"}


@router.get("/get_server_capabilities")
def get_server_capabilities(st: State) -> dict:
    # "vision" (takes image chunks) is Whitney's own field; the SDK's SupportedModel keeps extra fields.
    return {"supported_models": [{"model_name": name, "max_context_length": st.model_info(name).max_context,
                                  "trainable": True, "sampleable": True,
                                  "vision": getattr(st.model_info(name), "vision", False)} for name in st.models]}


class CreateSession(TinkerBody):
    tags: list[str] = []
    user_metadata: dict[str, Any] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


@router.post("/create_session")
def create_session(body: CreateSession, st: State, who: Owner) -> dict:
    """A native session with the caller's user_metadata, tags, project and display name (search_sessions and
    GET /v1/sessions find it by them)."""
    check_metadata(st.limits, body.user_metadata)
    projects.check_labels(body.tags, body.project_id, body.display_name)
    session = labelled_session(st, who, dict(body.user_metadata or {}), tags=body.tags, project_id=body.project_id,
                               display_name=body.display_name)
    return {"type": "create_session", "session_id": session.id}


def labelled_session(st: ServiceState, who: str, user_metadata: dict, **labels) -> SessionRecord:
    session = st.store.create_session(who, user_metadata, admit=lambda conn: st.quotas.check_session(who, conn))
    return projects.label(st.store, session.id, who, **labels)


class SessionRef(TinkerBody):
    session_id: str


@router.post("/session_heartbeat", responses={410: {"model": schemas.Error, "description": "the session has ended "
                                                     "(code conflict): the SDK stops heartbeating"}})
def session_heartbeat(body: SessionRef, st: State, who: Owner):
    """410 once the session has ended: the SDK then stops its heartbeat loop."""
    try:
        st.store.heartbeat(body.session_id, who)
    except Conflict as e:
        return JSONResponse(status_code=410, content=e.to_dict())
    return {"type": "session_heartbeat"}


@router.post("/telemetry")
def telemetry() -> dict:
    """Accepted and dropped: telemetry is for the hosted service."""
    return {"status": "accepted"}


@router.post("/sessions/{session_id}/finish")
async def finish_session(session_id: str, st: State, who: Owner) -> dict:
    """End the session: each active run finishes (what it has queued still runs). First finish wins."""
    finishing = await run_in_threadpool(_close, st, who, session_id)  # store writes: off the event loop
    for run_id in finishing:
        await asyncio.wrap_future(st.scheduler.finish_run(run_id))
    return {}


def _close(st: ServiceState, who: str, session_id: str) -> list[str]:
    """Close the caller's session; the ids of its active runs, each now finishing."""
    st.store.get_session(session_id, who)
    st.store.end_session(session_id, SessionStatus.CLOSED)
    return [run.id for run in st.store.runs_of_session(session_id)
            if st.store.set_run_status(run.id, RunStatus.FINISHING)]  # an active run


@router.get("/sessions")
def list_sessions(st: State, who: Owner) -> dict:
    return {"sessions": [s.id for s in st.store.list_sessions(who)]}


@router.get("/sessions/{session_id}")
def get_session(session_id: str, st: State, who: Owner, ts: Tinker) -> dict:
    session = st.store.get_session(session_id, who)
    return {"training_run_ids": [r.id for r in st.store.runs_of_session(session_id)],
            "sampler_ids": [k for k, v in ts.samplers.items() if k.startswith(f"{session_id}:") and v.owner == who],
            "user_metadata": session.user_metadata, "display_name": session.display_name}
