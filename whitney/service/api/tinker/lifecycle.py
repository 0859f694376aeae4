"""Tinker's checkpoint lifecycle: TTLs, publishing, copies, and the download URLs of external (PEFT) exports.

A tinker:// path names every version of a checkpoint name: a TTL or a publish applies to all of them, as a
delete does. The rules are packages.py's (readers, the reaper, who may read and write).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Header, Request

from whitney.errors import Conflict, InvalidInput, NotFound
from whitney.protocol.backend import PackageKind
from whitney.service.api.native.checkpoints import signed_urls
from whitney.service.api.tinker.common import (SEGMENT_KIND, Tinker, TinkerBody, access_owner, iso, model_id,
                                               packages_named, resolve_path, tinker_path)
from whitney.service.api.tinker.session import labelled_session
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.store import packages
from whitney.service.store.lifecycle import RunStatus, SessionStatus
from whitney.service.store.records import PackageRecord

router = new_router()
CHECKPOINT = "/training_runs/{run_id}/checkpoints/{checkpoint_id:path}"


def versions(st: ServiceState, who: str, run_id: str, checkpoint_id: str) -> list[PackageRecord]:
    """Every version of the caller's checkpoint `weights/{name}`, `sampler_weights/{name}` or
    `external_weights/{name}` of that run (404 when there is none)."""
    segment, _, name = checkpoint_id.partition("/")
    found = packages_named(st, who, run_id, SEGMENT_KIND[segment], name) if segment in SEGMENT_KIND and name else []
    if not found:
        raise NotFound(f"training run {run_id!r} has no checkpoint {checkpoint_id!r}", field="checkpoint_id")
    return found


class Ttl(TinkerBody):
    ttl_seconds: int | None = None


@router.put(CHECKPOINT + "/ttl")
def set_ttl(run_id: str, checkpoint_id: str, body: Ttl, st: State, who: Owner) -> None:
    """Expire the checkpoint ttl_seconds from now (the server then deletes it); null removes the expiry."""
    packages.check_ttl(body.ttl_seconds)
    for package in versions(st, who, run_id, checkpoint_id):
        packages.settle(st.store, package.id, who, ttl_seconds=body.ttl_seconds, clear_ttl=body.ttl_seconds is None)


def _publish(st: ServiceState, who: str, run_id: str, checkpoint_id: str, public: bool) -> None:
    moved = 0
    for package in versions(st, who, run_id, checkpoint_id):
        try:
            packages.publish(st.store, package.id, who, public)
            moved += 1
        except Conflict:
            pass
    if not moved:
        raise Conflict(f"checkpoint {checkpoint_id!r} is already {'public' if public else 'private'}",
                       field="checkpoint_id")


@router.post(CHECKPOINT + "/publish")
def publish(run_id: str, checkpoint_id: str, st: State, who: Owner) -> None:
    """Readable by every key (load, sample, copy, download); still writable only by its owner."""
    _publish(st, who, run_id, checkpoint_id, True)


@router.delete(CHECKPOINT + "/publish")
def unpublish(run_id: str, checkpoint_id: str, st: State, who: Owner) -> None:
    _publish(st, who, run_id, checkpoint_id, False)


@router.get(CHECKPOINT + "/external_weights_urls")
def external_weights_urls(run_id: str, checkpoint_id: str, request: Request, st: State, who: Owner) -> dict:
    """A signed URL per file of a PEFT export: a plain GET fetches it, no key needed, for an hour."""
    package = resolve_path(st, who, f"tinker://{run_id}/{checkpoint_id}")
    if package.kind != PackageKind.LORA:
        raise InvalidInput("only external_weights checkpoints have download URLs", field="checkpoint_id")
    found = signed_urls(request, package)
    return {"urls": found["urls"], "expires": iso(found["expires_at"])}


class CopyWeights(TinkerBody):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


@router.post("/copy_weights")
def copy_weights(body: CopyWeights, st: State, who: Owner, ts: Tinker,
                 x_idempotency_key: Annotated[str | None, Header()] = None,
                 x_tinker_weights_access_token: Annotated[str | None, Header()] = None) -> dict[str, Any]:
    """A copy of a checkpoint the caller may read (its own, a public one, or one of the key it presents as
    weights access token) in a run of its own that is not trained on: model_seq_id of session_id, or a new
    session in destination_project_id. The files are hard links. A retry with the same X-Idempotency-Key
    returns the first copy."""
    retry = (who, x_idempotency_key)
    if x_idempotency_key is not None and retry in ts.copies:
        return {"tinker_path": ts.copies[retry]}
    packages.check_ttl(body.ttl_seconds)
    also = access_owner(st, x_tinker_weights_access_token or body.weights_access_token)
    source = resolve_path(st, who, body.source_path, also)
    if body.session_id is not None:
        if body.model_seq_id is None:
            raise InvalidInput("session_id needs model_seq_id", field="model_seq_id")
        session_id = body.session_id
    elif body.destination_project_id is not None:
        session_id = labelled_session(st, who, {}, project_id=body.destination_project_id).id
    else:
        raise InvalidInput("give destination_project_id, or session_id with model_seq_id",
                           field="destination_project_id")
    run_id = model_id(session_id, body.model_seq_id or 0)
    try:
        st.store.get_run(run_id, who)
    except NotFound:  # a run that holds the copy and is never trained (finished at once: it holds no adapter)
        lora = st.store.get_run(source.run_id).lora
        st.store.create_run(session_id, who, source.base_model, lora, None, False, {"copied_from": body.source_path},
                            run_id=run_id)
        st.store.set_run_status(run_id, RunStatus.FINISHED)
    if body.session_id is None:
        st.store.end_session(session_id, SessionStatus.CLOSED)
    copy = packages.copy(st.store, source, who, run_id, ttl_seconds=body.ttl_seconds)
    path = tinker_path(copy)
    if x_idempotency_key is not None:
        with ts.lock:
            ts.copies[retry] = path
    return {"tinker_path": path}

