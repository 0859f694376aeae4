"""Ordered training operations of a run, and polling any operation to its end."""

from __future__ import annotations

import json
from dataclasses import asdict

from fastapi import Query
from starlette.concurrency import run_in_threadpool

from whitney.errors import Conflict, InvalidInput
from whitney.protocol.backend import PackageKind
from whitney.protocol.training import AdamParams
from whitney.service.api import images
from whitney.service.api.native import schemas
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.http.heavy import run_checked
from whitney.service.scheduling.jobs import ForwardJob, Job, LoadJob, OptimJob, SaveJob
from whitney.service.scheduling.limits import check_operation
from whitney.service.store import custom_losses
from whitney.service.store.database import digest
from whitney.service.store.json_values import check_json
from whitney.service.store.lifecycle import OPERATION_TERMINAL, OperationKind, RunStatus
from whitney.service.store.packages import reading
from whitney.service.store.records import OperationRecord

router = new_router(prefix="/v1", tags=["operations"])
MAX_WAIT = 30.0


def submit(st: ServiceState, who: str, run_id: str, kind: str, body: schemas.Wire,
           job: Job | None, counted: int = 0) -> OperationRecord:
    """`enqueue` a native request: its digest is the body's."""
    return enqueue(st, who, run_id, body.seq_id, kind, digest({"kind": kind, **body.model_dump()}), job, counted)


def enqueue(st: ServiceState, who: str, run_id: str, seq_id: int, kind: str, body_digest: str,
            job: Job | None, counted: int = 0) -> OperationRecord:
    """Record (run, seq_id) in the store (a retry with the same body returns the same operation) and queue
    its job (None: only a retry of an ended run's operation, which is never queued again). Shared with
    the Tinker routes. The store checks the run (404, 409 once it has ended) and the quota (429, never for
    a retry) in the one call. `counted`: tokens of the job already counted against the key's tokens per minute
    (as it was validated: Quotas.validating)."""
    tokens = max(0, job.tokens - counted) if isinstance(job, ForwardJob) else 0
    # A load counts as the checkpoint's reader until it ends, so the TTL reaper never deletes it first (packages.py).
    op, created = reading(st.store, job.path if isinstance(job, LoadJob) else None, lambda: st.store.submit_operation(
        who, run_id, seq_id, kind, body_digest,
        admit=lambda conn: st.quotas.admit_operation(who, run_id, seq_id, tokens, conn), config=shown_config(job),
        payload=st.payload(job) if job is not None else None))
    if created and job is not None:
        st.scheduler.submit(op, job)
    return op


def shown_config(job: Job | None) -> dict | None:
    """What the console's configuration panel shows of an operation, kept beside it: a forward's loss and its
    config (a config over 2 KiB, a custom loss's graph, only as its size), an optim_step's hyperparameters."""
    if isinstance(job, OptimJob):
        return {"adam_params": asdict(job.params)}
    if isinstance(job, ForwardJob):
        size = len(json.dumps(job.loss_config, separators=(",", ":")))
        return {"loss_fn": job.loss_fn, **({"loss_config": job.loss_config} if size <= 2048 else
                                           {"loss_config_bytes": size})}
    return None


def _forward(st: ServiceState, who: str, run_id: str, body: schemas.ForwardPayload,
             backward: bool) -> OperationRecord:
    run = st.store.get_run(run_id, who)
    kind = OperationKind.FORWARD_BACKWARD if backward else OperationKind.FORWARD
    if run.status != RunStatus.ACTIVE or st.store.find_operation(run_id, body.seq_id) is not None:
        # A retry of a seq_id the run has (or a Conflict): the store answers, nothing is read or validated again.
        # An ended run takes no other (the store refuses it).
        return submit(st, who, run_id, kind, body, None)
    # Image chunks read (asset pointers from allowed directories) and checked against the image limits; a model
    # without vision refuses them before any is read.
    budget = images.ImageBudget(st.limits, st.model_info(run.base_model), run.base_model)
    data = images.datums([d.model_dump() for d in body.data], budget)
    lengths = [images.known_length(d.token_ids) for d in data]
    check_operation(st.limits, lengths)  # before the backend looks at any of it
    with_images = next((i for i, d in enumerate(data) if images.has_images(d.token_ids)), None)
    if with_images is not None:
        images.refuse_images(st.model_info(run.base_model), run.base_model, f"data[{with_images}].input.chunks",
                             with_images)
    check_json(body.loss_config, "loss_config")  # a free JSON object, kept beside the operation (shown_config)
    # loss "custom": {"loss_id": id} becomes the stored definition (routes/custom_losses.py).
    config = custom_losses.resolve(st.store, who, body.loss_function, body.loss_config)
    # Validated now, so a bad datum is a 400 naming it rather than a failed operation later. The work counts against
    # the key's share (Quotas.validating): its tokens per minute, passed or not, and a bound on heavy checks at once,
    # which run at a low CPU priority (http/heavy.py).
    counted = sum(lengths)
    heavy = body.loss_function == custom_losses.CUSTOM or with_images is not None
    try:
        checked = run_checked(st.quotas, who, counted, heavy, st.scheduler.backend.validate,
                              st.forward_check(run_id, data, body.loss_function, config), backward)
    except InvalidInput as e:
        if e.field == "loss_fn":  # the engine's name; on the wire it is loss_function
            e.field = "loss_function"
        raise
    if with_images is not None:  # the engine's processor has counted each image's positions
        check_operation(st.limits, checked.positions_D)
    job = ForwardJob(data, body.loss_function, config, checked.positions_D, checked.cost_D)
    return submit(st, who, run_id, kind, body, job, counted)


@router.post("/runs/{run_id}/forward_backward", response_model=schemas.Operation, status_code=202)
def forward_backward(run_id: str, body: schemas.ForwardPayload, st: State, who: Owner):
    """Loss, log-probs and gradients (accumulated until the next optim_step)."""
    return _forward(st, who, run_id, body, backward=True)


@router.post("/runs/{run_id}/forward", response_model=schemas.Operation, status_code=202)
def forward(run_id: str, body: schemas.ForwardPayload, st: State, who: Owner):
    """Loss and log-probs without gradients."""
    return _forward(st, who, run_id, body, backward=False)


@router.post("/runs/{run_id}/optim_step", response_model=schemas.Operation, status_code=202)
def optim_step(run_id: str, body: schemas.OptimStep, st: State, who: Owner):
    job = OptimJob(AdamParams.from_dict(body.adam_params.model_dump()))  # range checks now: a 400, not a failure later
    return submit(st, who, run_id, OperationKind.OPTIM_STEP, body, job)


def _load(st: ServiceState, who: str, run_id: str, body: schemas.LoadState,
          with_optimizer: bool) -> OperationRecord:
    run = st.store.get_run(run_id, who)
    if run.resume_from is not None and body.seq_id == 0:
        raise Conflict("this run was bound to a checkpoint at creation; load_state as its first operation as "
                       "well is refused (do one or the other)", field="seq_id")
    package = st.store.get_package(body.checkpoint_id, who)
    if package.kind not in (PackageKind.STATE, PackageKind.SAMPLER):
        raise InvalidInput(f"checkpoint {package.id} is a {package.kind} export, not a saved state",
                           field="checkpoint_id")
    if with_optimizer and not package.has_optimizer:
        raise InvalidInput("the checkpoint has no optimizer state; use load_state", field="checkpoint_id")
    kind = OperationKind.LOAD_STATE_WITH_OPTIMIZER if with_optimizer else OperationKind.LOAD_STATE
    return submit(st, who, run_id, kind, body, LoadJob(package.path, package.id))


@router.post("/runs/{run_id}/load_state", response_model=schemas.Operation, status_code=202)
def load_state(run_id: str, body: schemas.LoadState, st: State, who: Owner):
    """Restore weights; the optimizer starts fresh."""
    return _load(st, who, run_id, body, with_optimizer=False)


@router.post("/runs/{run_id}/load_state_with_optimizer", response_model=schemas.Operation, status_code=202)
def load_state_with_optimizer(run_id: str, body: schemas.LoadState, st: State, who: Owner):
    """Restore weights and optimizer: training continues exactly where the checkpoint left off."""
    return _load(st, who, run_id, body, with_optimizer=True)


@router.post("/runs/{run_id}/save_state", response_model=schemas.Operation, status_code=202)
def save_state(run_id: str, body: schemas.SaveState, st: State, who: Owner):
    return submit(st, who, run_id, OperationKind.SAVE_STATE, body,
                  SaveJob(body.name, include_optimizer=body.include_optimizer))


@router.post("/runs/{run_id}/save_weights", response_model=schemas.Operation, status_code=202)
def save_weights(run_id: str, body: schemas.SaveWeights, st: State, who: Owner):
    return submit(st, who, run_id, OperationKind.SAVE_WEIGHTS, body, SaveJob(body.name, merge=body.merge))


@router.post("/runs/{run_id}/export_lora", response_model=schemas.Operation, status_code=202)
def export_lora(run_id: str, body: schemas.ExportLora, st: State, who: Owner):
    return submit(st, who, run_id, OperationKind.EXPORT_LORA, body, SaveJob(body.name))


@router.post("/runs/{run_id}/save_weights_for_sampler", response_model=schemas.Operation, status_code=202)
def save_weights_for_sampler(run_id: str, body: schemas.SaveForSampler, st: State, who: Owner):
    """Snapshot the adapter as the next sampler version; sampling that version never sees later training."""
    return submit(st, who, run_id, OperationKind.SAVE_WEIGHTS_FOR_SAMPLER, body, SaveJob())


@router.get("/runs/{run_id}/operations", response_model=list[schemas.Operation])
def list_operations(run_id: str, st: State, who: Owner):
    st.store.get_run(run_id, who)
    return st.store.list_operations(run_id)


@router.get("/operations/{op_id}", response_model=schemas.Operation)
async def get_operation(op_id: str, st: State, who: Owner,
                        wait: float = Query(0.0, ge=0.0, le=MAX_WAIT, description="long-poll up to this many seconds")):
    """An operation's state; with `wait`, held until it is terminal or the wait ends."""
    op = await run_in_threadpool(st.store.get_operation, op_id, who)  # store reads: off the event loop
    if wait > 0 and op.status not in OPERATION_TERMINAL:
        await st.scheduler.wait(op_id, wait)
        op = await run_in_threadpool(st.store.get_operation, op_id, who)
    return op
