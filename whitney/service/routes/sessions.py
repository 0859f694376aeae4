"""Sessions and the runs inside them."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter

from whitney.errors import Conflict, InvalidInput
from whitney.service import schemas
from whitney.service.deps import Owner, ServiceState, State
from whitney.service.lifecycle import RunStatus, SessionStatus
from whitney.service.limits import check_metadata
from whitney.service.store import new_id

router = APIRouter(prefix="/v1", tags=["sessions"])


@router.post("/sessions", response_model=schemas.Session, status_code=201)
def create_session(body: schemas.SessionCreate, st: State, who: Owner):
    check_metadata(st.limits, body.user_metadata)
    st.quotas.check_session(who)
    return st.store.create_session(who, body.user_metadata)


@router.get("/sessions", response_model=list[schemas.Session])
def list_sessions(st: State, who: Owner):
    return st.store.list_sessions(who)


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
        if st.store.set_run_status(run["id"], RunStatus.CANCELLING):  # an active or finishing run
            st.scheduler.cancel_run(run["id"], "session closed")
    return st.store.get_session(session_id, who)


@router.post("/sessions/{session_id}/runs", response_model=schemas.Run, status_code=201)
async def create_run(session_id: str, body: schemas.RunCreate, st: State, who: Owner):
    """A LoRA run on a base model, optionally bound to a checkpoint it resumes from."""
    return await open_run(st, who, session_id, body)


async def open_run(st: ServiceState, who: str, session_id: str, body: schemas.RunCreate,
                   run_id: str | None = None) -> dict:
    """Create a run (adapter in the engine first, then the row); shared with the Tinker routes."""
    check_metadata(st.limits, body.user_metadata)
    session = st.store.get_session(session_id, who)
    if session["status"] != SessionStatus.ACTIVE:
        raise Conflict(f"session {session_id!r} is {session['status']}", field="session_id")
    base_model, lora, resume_path = body.base_model, body.lora.model_dump(), None
    if body.resume_from is not None:
        package = st.store.get_package(body.resume_from.checkpoint_id, who)
        if package["kind"] not in ("state", "sampler"):
            raise InvalidInput(f"checkpoint {package['id']} is a {package['kind']} export, not a saved state",
                               field="resume_from.checkpoint_id")
        if body.resume_from.with_optimizer and not package["has_optimizer"]:
            raise InvalidInput("the checkpoint has no optimizer state; resume with with_optimizer=false",
                               field="resume_from.with_optimizer")
        base_model = base_model or package["base_model"]
        if "lora" not in body.model_fields_set:  # the checkpoint's own LoRA geometry
            lora = st.store.get_run(package["run_id"])["lora"]
        resume_path = package["path"]
    base_model = base_model or st.models[0]
    if not st.serves(base_model):
        raise InvalidInput(f"base model {base_model!r} is not served here; served: {st.models}", field="base_model")
    st.quotas.check_run(who, base_model, lora)  # the key's live runs and their adapters' memory
    run = {"id": run_id or new_id("run"), "base_model": base_model, "lora": lora,
           "resume_with_optimizer": bool(body.resume_from and body.resume_from.with_optimizer)}
    # The engine validates the LoRA config against the model; only then is the run recorded.
    await asyncio.wrap_future(st.scheduler.open_run(run, resume_path))
    return st.store.create_run(session_id, who, base_model, lora,
                               body.resume_from.checkpoint_id if body.resume_from else None,
                               run["resume_with_optimizer"], body.user_metadata, run_id=run["id"])


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
    st.store.get_run(run_id, who)
    if not st.store.set_run_status(run_id, RunStatus.FINISHING):  # only an active run
        raise Conflict(f"run {run_id!r} is {st.store.get_run(run_id)['status']}", field="run_id")
    await asyncio.wrap_future(st.scheduler.finish_run(run_id))
    return st.store.get_run(run_id, who)


@router.post("/runs/{run_id}/cancel", response_model=schemas.Run)
def cancel_run(run_id: str, st: State, who: Owner):
    """Cancel queued operations; the running one ends; the run becomes cancelled."""
    st.store.get_run(run_id, who)
    if st.store.set_run_status(run_id, RunStatus.CANCELLING):  # an active or finishing run
        st.scheduler.cancel_run(run_id)
    return st.store.get_run(run_id, who)
