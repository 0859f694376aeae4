"""Sessions and the runs inside them; sessions' labels (tags, project, display name), what they did, and who
the caller is."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Annotated

import anyio
from fastapi import Header, Query, Request
from starlette.concurrency import run_in_threadpool

from whitney.errors import Conflict, InvalidInput, NotFound
from whitney.protocol.backend import PackageKind
from whitney.service.api.native import schemas
from whitney.service.http import signing
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.scheduling.limits import check_metadata
from whitney.service.store import packages, projects
from whitney.service.store.keys import key_digest, presented_key
from whitney.service.store.lifecycle import RunStatus, SessionStatus
from whitney.service.store.records import OperationRecord, RunRecord
from whitney.service.store.tables import new_id

router = new_router(prefix="/v1", tags=["sessions"])


@router.post("/sessions", response_model=schemas.Session, status_code=201)
def create_session(body: schemas.SessionCreate, st: State, who: Owner):
    check_metadata(st.limits, body.user_metadata)
    session = st.store.create_session(who, body.user_metadata, admit=lambda conn: st.quotas.check_session(who, conn))
    return projects.label(st.store, session.id, who, tags=body.tags, project_id=body.project_id,
                          display_name=body.display_name)


@router.get("/sessions", response_model=list[schemas.Session])
def list_sessions(st: State, who: Owner, tag: Annotated[list[str], Query()] = [],  # noqa: B006 (FastAPI's form)
                  project_id: str | None = None, display_name: str | None = None, status: SessionStatus | None = None):
    """The caller's sessions, oldest first; each filter given must hold: every `tag` (repeatable) held, the
    project, every word of `display_name` in the name (case-insensitive), the status."""
    found = projects.find_sessions(st.store, who, tags=tag, display_name=display_name,
                                   project_ids=None if project_id is None else [project_id],
                                   statuses=None if status is None else [status])
    return found[::-1]


@router.patch("/sessions/{session_id}", response_model=schemas.Session, status_code=200)
def label_session(session_id: str, body: schemas.SessionLabels, st: State, who: Owner):
    """Set tags, project_id and/or display_name (fields left out stay as they are)."""
    return projects.label(st.store, session_id, who, tags=body.tags, project_id=body.project_id,
                          display_name=body.display_name)


@router.get("/sessions/{session_id}/operations", response_model=list[schemas.TraceEvent])
def session_operations(session_id: str, st: State, who: Owner):
    """Every operation of the session's runs, in the order they were made, with its timestamps and status."""
    return [trace_event(op) for op in projects.session_operations(st.store, session_id, who)]


def trace_event(op: OperationRecord) -> dict:
    return {"operation_id": op.id, "kind": op.kind, "run_id": op.run_id, "seq_id": op.seq_id, "status": op.status,
            "created_at": op.created_at, "started_at": op.started_at, "finished_at": op.finished_at,
            "error_code": (op.error or {}).get("code")}


@router.get("/sessions/{session_id}/trace")
def session_trace(session_id: str, st: State, who: Owner) -> dict:
    """The session's operations as a Chrome trace-event document (open it in Perfetto or chrome://tracing)."""
    return projects.trace_events(st.store.get_session(session_id, who),
                                 projects.session_operations(st.store, session_id, who))


def signed_trace_url(request: Request, session_id: str, seconds: int = 3600) -> str:
    expires = int(time.time()) + seconds
    signature = signing.sign(f"trace/{session_id}/{expires}")
    base = f"{request.url.scheme}://{request.url.netloc}/v1/signed/sessions"
    return f"{base}/{session_id}/{expires}/{signature}/trace.json"


@router.get("/signed/sessions/{session_id}/{expires}/{signature}/trace.json")
def signed_trace(session_id: str, expires: int, signature: str, st: State) -> dict:
    """A session's trace by a signed URL (Tinker's export_session_trace): no key needed until it expires."""
    if expires < time.time() or not signing.verify(f"trace/{session_id}/{expires}", signature):
        raise NotFound("this trace URL has expired or is not valid; ask for a new one", field="signature")
    owner = projects.session_owner(st.store, session_id)
    return projects.trace_events(st.store.get_session(session_id, owner),
                                 projects.session_operations(st.store, session_id, owner))


@router.get("/audit", response_model=list[schemas.TraceEvent])
def audit(st: State, who: Owner, since: float = 0.0, until: float | None = None):
    """Every operation the caller's key made in [since, until) (unix seconds; default: all), oldest first."""
    return [trace_event(op) for op in projects.owner_operations(st.store, who, since, until or time.time() + 1)]


@router.get("/whoami", response_model=schemas.Whoami)
def whoami(st: State, who: Owner, authorization: Annotated[str | None, Header()] = None,
           x_api_key: Annotated[str | None, Header()] = None):
    """The caller's key: its id and name (`whitney keys list`) and the owner digest its rows carry."""
    return identity(st, who, presented_key(authorization, x_api_key))


def identity(st: ServiceState, who: str, credential: str | None) -> dict:
    digest = key_digest(credential) if who else None
    row = st.store.find_key(digest) if digest else None
    return {"key_id": row.id if row else None, "name": row.name if row else None, "owner": who}


@router.get("/sessions/{session_id}", response_model=schemas.Session)
def get_session(session_id: str, st: State, who: Owner):
    return st.store.get_session(session_id, who)


@router.post("/sessions/{session_id}/heartbeat", response_model=schemas.Session)
def heartbeat(session_id: str, st: State, who: Owner):
    return st.store.heartbeat(session_id, who)


@router.post("/sessions/{session_id}/close", response_model=schemas.Session)
def close_session(session_id: str, st: State, who: Owner):
    """Close a session: its runs are cancelled."""
    st.store.get_session(session_id, who)
    st.store.end_session(session_id, SessionStatus.CLOSED)
    for run in st.store.runs_of_session(session_id):
        if st.store.set_run_status(run.id, RunStatus.CANCELLING):  # an active or finishing run
            st.scheduler.cancel_run(run.id, "session closed")
    return st.store.get_session(session_id, who)


@router.post("/sessions/{session_id}/runs", response_model=schemas.Run, status_code=201)
async def create_run(session_id: str, body: schemas.RunCreate, st: State, who: Owner):
    """A LoRA run on a base model, optionally bound to a checkpoint it resumes from."""
    return await open_run(st, who, session_id, body)


async def open_run(st: ServiceState, who: str, session_id: str, body: schemas.RunCreate,
                   run_id: str | None = None, also: str | None = None) -> RunRecord:
    """Create a run (adapter in the engine first, then the row); shared with the Tinker routes. It may resume
    from the caller's checkpoint, a public one, or one of `also` (a second key the caller presented)."""
    check_metadata(st.limits, body.user_metadata)
    # Every store call on the thread pool: this route is async (it awaits the engine's open_run).
    session = await run_in_threadpool(st.store.get_session, session_id, who)
    if session.status != SessionStatus.ACTIVE:
        raise Conflict(f"session {session_id!r} is {session.status}", field="session_id")
    base_model, lora, resume_path = body.base_model, body.lora.model_dump(), None
    if body.resume_from is not None:
        package = await run_in_threadpool(packages.readable, st.store, body.resume_from.checkpoint_id, who, also)
        if package.kind not in (PackageKind.STATE, PackageKind.SAMPLER):
            raise InvalidInput(f"checkpoint {package.id} is a {package.kind} export, not a saved state",
                               field="resume_from.checkpoint_id")
        if body.resume_from.with_optimizer and not package.has_optimizer:
            raise InvalidInput("the checkpoint has no optimizer state; resume with with_optimizer=false",
                               field="resume_from.with_optimizer")
        base_model = base_model or package.base_model
        if "lora" not in body.model_fields_set:  # the checkpoint's own LoRA geometry
            lora = (await run_in_threadpool(st.store.get_run, package.run_id)).lora
        resume_path = package.path
    base_model = base_model or st.models[0]
    if not st.serves(base_model):
        raise InvalidInput(f"base model {base_model!r} is not served here; served: {st.models}", field="base_model")
    with_optimizer = bool(body.resume_from and body.resume_from.with_optimizer)
    # The run is recorded first, in one step with the quota check (the key's live runs and their adapters' memory:
    # concurrent requests never pass it together), so its place is held before the engine allocates anything.
    run = await run_in_threadpool(st.store.create_run, session_id, who, base_model, lora,
                                  body.resume_from.checkpoint_id if body.resume_from else None, with_optimizer,
                                  body.user_metadata, run_id=run_id or new_id("run"),
                                  admit=lambda conn: st.quotas.check_run(who, base_model, lora, conn))
    # The engine validates the LoRA config against the model; a refusal removes the run again. The checkpoint counts
    # as read while it loads, so the TTL reaper (packages.py) does not delete it under the load.
    try:
        async with _reading(st, resume_path):
            await asyncio.wrap_future(st.scheduler.open_run(run.id, base_model, lora, resume_path, with_optimizer))
    except Exception:  # not a cancelled request: the engine still opens that run, which keeps its place
        await run_in_threadpool(st.store.drop_run, run.id)
        raise
    return run


@contextlib.asynccontextmanager
async def _reading(st: ServiceState, path: str | None):
    """packages.Reading for an async route: the package at `path` (None: none) counts as read meanwhile, its store
    writes on the thread pool."""
    if path is None:
        yield
        return
    if not await run_in_threadpool(packages.acquire, st.store, path):
        raise packages.gone(path)
    try:
        yield
    finally:
        with anyio.CancelScope(shield=True):
            await run_in_threadpool(packages.release, st.store, path)


@router.get("/sessions/{session_id}/runs", response_model=list[schemas.Run])
def list_runs(session_id: str, st: State, who: Owner):
    st.store.get_session(session_id, who)
    return st.store.list_runs(who, session_id)


@router.get("/runs/{run_id}", response_model=schemas.Run)
def get_run(run_id: str, st: State, who: Owner):
    return st.store.get_run(run_id, who)


@router.post("/runs/{run_id}/finish", response_model=schemas.Run)
async def finish_run(run_id: str, st: State, who: Owner):
    """Run what is queued, then mark the run finished (finished at once when nothing is queued)."""
    await run_in_threadpool(_finishing, st, who, run_id)  # store calls: off the event loop
    await asyncio.wrap_future(st.scheduler.finish_run(run_id))
    return await run_in_threadpool(st.store.get_run, run_id, who)


def _finishing(st: ServiceState, who: str, run_id: str) -> None:
    st.store.get_run(run_id, who)
    if not st.store.set_run_status(run_id, RunStatus.FINISHING):  # only an active run
        raise Conflict(f"run {run_id!r} is {st.store.get_run(run_id).status}", field="run_id")


@router.post("/runs/{run_id}/cancel", response_model=schemas.Run)
def cancel_run(run_id: str, st: State, who: Owner):
    """Cancel queued operations; the running one ends; the run becomes cancelled."""
    st.store.get_run(run_id, who)
    if st.store.set_run_status(run_id, RunStatus.CANCELLING):  # an active or finishing run
        st.scheduler.cancel_run(run_id)
    return st.store.get_run(run_id, who)
