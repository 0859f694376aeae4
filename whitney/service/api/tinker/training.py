"""Tinker's training calls, each mapped onto the native run operations (same store rows, same scheduler queue).

Every call that carries a seq_id holds that place in the run's order even when it is refused: a
refusal found here becomes an operation that fails in its turn (category "user"), so the requests
the SDK already sent behind it still run. forward_backward is validated by the engine in its turn
for the same reason.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

from fastapi import Request
from starlette.concurrency import run_in_threadpool

from whitney.errors import InvalidInput, WhitneyError
from whitney.protocol.backend import Failure, PackageKind
from whitney.protocol.training import AdamParams, Checked
from whitney.service.api import images
from whitney.service.api.native import schemas
from whitney.service.api.native.operations import enqueue
from whitney.service.api.native.sessions import open_run
from whitney.service.api.tinker import proto
from whitney.service.api.tinker.common import (NAME, Sampler, Tinker, TinkerBody, access_owner, model_id, native_seq,
                                               packages_named, path_of, resolve_path, served, tinker_path)
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.http.heavy import run_checked
from whitney.service.scheduling.jobs import ForwardJob, Job, LoadJob, OptimJob, Refused, SaveJob
from whitney.service.scheduling.limits import check_metadata, check_operation
from whitney.service.store import custom_losses, packages
from whitney.service.store.database import digest
from whitney.service.store.lifecycle import OperationKind, OperationStatus
from whitney.service.store.records import OperationRecord

router = new_router()


def future(op: OperationRecord, **extra: Any) -> dict:
    """Tinker's UntypedAPIFuture for an operation."""
    return {"request_id": op.id, **extra}


def finished_op(st: ServiceState, who: str, kind: OperationKind, result: dict) -> OperationRecord:
    """An operation that is done when created (create_model, create-by-load), so retrieve_future answers it."""
    op, _ = st.store.submit_operation(who, None, None, kind, "")
    st.store.set_operation(op.id, OperationStatus.SUCCEEDED, result={"tinker": result})
    return op


def submit(st: ServiceState, who: str, run_id: str, seq_id: int, kind: str, body_digest: str,
           job: Job) -> OperationRecord:
    """Record (run, native seq_id) and queue it; a resend with the same body is the same operation."""
    return enqueue(st, who, run_id, native_seq(seq_id), kind, digest({"kind": kind, "body": body_digest}), job)


def refused(error: WhitneyError) -> Refused:
    return Refused(Failure.of(error))


# ---- models --------------------------------------------------------------------------------

class LoraConfig(TinkerBody):
    rank: schemas.Rank = 32  # the native LoraSpec's rules: it is built from this one
    seed: schemas.Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModel(TinkerBody):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: dict[str, Any] | None = None


def _check_optimizer(config: dict | None) -> None:
    if config is not None and config.get("type", "adamw") != "adamw":
        raise InvalidInput(f"optimizer {config.get('type')!r} is not supported; only adamw", field="optimizer_config")


@router.post("/create_model")
async def create_model(body: CreateModel, st: State, who: Owner) -> dict:
    """A LoRA run whose id is the Tinker model id; the future's result is {model_id}."""
    _check_optimizer(body.optimizer_config)
    run_id = model_id(body.session_id, body.model_seq_id)
    lora = body.lora_config or LoraConfig()
    if not await run_in_threadpool(_run_exists, st, who, run_id):  # else a resent create_model: the run exists
        seed = lora.seed if lora.seed is not None else random.randrange(2**31)
        spec = schemas.LoraSpec(rank=lora.rank, seed=seed, train_attn=lora.train_attn, train_mlp=lora.train_mlp,
                                train_unembed=lora.train_unembed)
        await open_run(st, who, body.session_id, schemas.RunCreate(
            base_model=served(st, body.base_model), lora=spec, user_metadata=body.user_metadata or {}), run_id)
    op = await run_in_threadpool(finished_op, st, who, OperationKind.CREATE_MODEL,
                                 {"model_id": run_id, "type": "create_model"})
    return future(op, model_id=run_id)


def _run_exists(st: ServiceState, who: str, run_id: str) -> bool:
    """Whether the caller has the run (a store read: the async routes call it on the thread pool)."""
    try:
        st.store.get_run(run_id, who)
    except WhitneyError:
        return False
    return True


class ModelRef(TinkerBody):
    model_id: str


@router.post("/get_info")
def get_info(body: ModelRef, st: State, who: Owner) -> dict:
    run = st.store.get_run(body.model_id, who)
    base = run.base_model
    return {"type": "get_info", "model_id": run.id, "is_lora": True, "lora_rank": run.lora["rank"],
            "model_name": base, "model_data": {"model_name": base, "tokenizer_id": base}}


# ---- forward, forward_backward and optim_step ------------------------------------------------

def loss_config(losses: dict, loss_fn: str, config: dict) -> dict:
    """Tinker's loss parameters: where the loss table (`Backend.losses()`) gives Tinker defaults (cispo's absolute
    0.8 / 1.2) and the request names none of the loss's keys, those. An unknown name is the engine's to refuse."""
    loss = losses.get(loss_fn)
    if loss and loss["tinker_defaults"] and not set(loss["config"]) & set(config):
        return {**config, **loss["tinker_defaults"]}
    return config


@router.post("/forward_backward")
async def forward_backward(request: Request, st: State, who: Owner) -> dict:
    """A protobuf ForwardBackwardRequest; forward() is the same call with forward_only."""
    if request.headers.get("content-encoding", "identity") not in ("identity", ""):
        raise InvalidInput("compressed forward_backward bodies are not supported (client/config does not ask "
                           "for them)", field="content-encoding")
    raw = await request.body()
    # Decoded off the event loop, every declared size checked against the limits before anything is made of it
    # (a 400 or 413 now).
    req = await run_in_threadpool(proto.decode_forward_backward, raw, st.limits)
    kind = OperationKind.FORWARD if req.forward_only else OperationKind.FORWARD_BACKWARD
    job: Job
    try:  # a model without vision refuses image chunks before any is read (failing in the operation's turn)
        budget = await run_in_threadpool(_image_budget, st, who, req)
    except WhitneyError as e:
        job = refused(e)
    else:
        # Image chunks checked against the image limits and decoded once, off the event loop (a 400 or 413 now,
        # like a malformed body); the positions each fills are checked below, a refusal failing in its turn.
        data = await run_in_threadpool(images.datums, req.data, budget, "data[{i}].model_input")
        lengths = [images.known_length(d.token_ids) for d in data]
        check_operation(st.limits, lengths)
        try:  # loss "custom": the stored definition its loss_id names (a refusal fails in its turn; a store read)
            config = loss_config(st.scheduler.backend.losses(), req.loss_fn, req.loss_fn_config)
            config = await run_in_threadpool(custom_losses.resolve, st.store, who, req.loss_fn, config)
            costs = None
            if req.loss_fn == custom_losses.CUSTOM or any(images.has_images(d.token_ids) for d in data):
                # The engine's processor counts each image's positions; a custom loss's graph is planned, its work
                # counted in the run's share. Either is a heavy check, one of the key's (Quotas.validating).
                checked = await run_in_threadpool(_heavy_check, st, who, req, data, config)
                lengths, costs = checked.positions_D, checked.cost_D
                check_operation(st.limits, lengths)
            job = ForwardJob(data, req.loss_fn, config, lengths, costs)
        except WhitneyError as e:
            job = refused(e)
    op = await run_in_threadpool(submit, st, who, req.model_id, req.seq_id, kind, hashlib.sha256(raw).hexdigest(),
                                 job)  # a store insert: off the event loop
    return future(op, model_id=req.model_id)


def _image_budget(st: ServiceState, who: str, req: proto.ForwardBackwardRequest) -> images.ImageBudget:
    """The request's image budget; when it holds an image, for its run's base model, and a model without vision
    refuses the first image chunk here, before any image is read."""
    first = next(((i, j) for i, d in enumerate(req.data) for j, c in enumerate(d["input"].get("chunks") or ())
                  if c["type"] != "encoded_text"), None)
    if first is None:
        return images.ImageBudget(st.limits)
    base_model = st.store.get_run(req.model_id, who).base_model
    budget = images.ImageBudget(st.limits, st.model_info(base_model), base_model)
    budget.admit_image(f"data[{first[0]}].model_input[{first[1]}]", first[0])
    return budget


def _heavy_check(st: ServiceState, who: str, req: proto.ForwardBackwardRequest, data: list, config: dict) -> Checked:
    """Backend.validate of a request with images or a custom loss, as one of the key's heavy checks (http/heavy.py;
    its tokens are counted when it is queued): each datum's positions (images expanded) and cost; an image whose
    expected_tokens the processor does not give, or a graph over its budget, is the engine's InvalidInput."""
    return run_checked(st.quotas, who, 0, True, st.scheduler.backend.validate,
                       st.forward_check(req.model_id, data, req.loss_fn, config), not req.forward_only)


class OptimStep(TinkerBody):
    model_id: str
    seq_id: int | None = None
    adam_params: dict[str, Any] | None = None
    optimizer_params: dict[str, Any] | None = None


ADAM_KEYS = {"learning_rate": "learning_rate", "beta1": "beta1", "beta2": "beta2", "eps": "eps",
             "weight_decay": "weight_decay", "grad_clip_norm": "gradient_clip_norm"}


@router.post("/optim_step")
def optim_step(body: OptimStep, st: State, who: Owner) -> dict:
    job: Job
    try:
        if body.adam_params is None:
            raise InvalidInput("only adam_params are supported", field="optimizer_params")
        job = OptimJob(AdamParams.from_dict({ADAM_KEYS[k]: v for k, v in body.adam_params.items() if k in ADAM_KEYS}))
    except WhitneyError as e:
        job = refused(e)
    op = submit(st, who, body.model_id, body.seq_id, OperationKind.OPTIM_STEP, digest(body.model_dump()), job)
    return future(op, model_id=body.model_id)


# ---- checkpoints ---------------------------------------------------------------------------

class SaveWeights(TinkerBody):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    kind: str | None = None
    overwrite: bool = False
    ttl_seconds: int | None = None  # the server deletes the checkpoint this long after it is written
    user_metadata: dict[str, Any] | None = None  # kept with the checkpoint (list_checkpoints shows it)


def _save_job(name: str | None, st: ServiceState | None = None, body: Any = None, **options: Any) -> Job:
    """A SaveJob, or a refusal (failing in its turn) of a bad name, TTL or metadata."""
    try:
        if name is not None and not NAME.match(name):
            raise InvalidInput(f"checkpoint name {name!r} must be 1-200 of A-Z a-z 0-9 . _ -", field="path")
        if body is not None:
            packages.check_ttl(body.ttl_seconds)
            check_metadata(st.limits, getattr(body, "user_metadata", None) or {})
    except WhitneyError as e:
        return refused(e)
    return SaveJob(name, **options)


def _saved(st: ServiceState, op: OperationRecord, body: Any, job: Job) -> dict:
    """The save's TTL and user_metadata, given to its package as it succeeds (packages.settle_at_end)."""
    if op.status == OperationStatus.QUEUED and not isinstance(job, Refused):
        packages.settle_at_end(st.store, op.id, body.ttl_seconds, getattr(body, "user_metadata", None))
    return future(op, model_id=body.model_id)


@router.post("/save_weights")
def save_weights(body: SaveWeights, st: State, who: Owner) -> dict:
    """save_state: adapter and optimizer, as tinker://{model_id}/weights/{name}."""
    name = body.path if body.path is not None else f"state-{body.seq_id}"
    job = _save_job(name, st, body, include_optimizer=True)
    if not body.overwrite and packages_named(st, who, body.model_id, PackageKind.STATE, name):
        job = refused(InvalidInput(f"checkpoint {name!r} exists; save with overwrite=True to replace it",
                                   field="path"))
    op = submit(st, who, body.model_id, body.seq_id, OperationKind.SAVE_STATE, digest(body.model_dump()), job)
    return _saved(st, op, body, job)


class SaveWeightsExternal(TinkerBody):
    model_id: str
    path: str
    seq_id: int | None = None
    ttl_seconds: int | None = None
    age_encryption_recipients: list[str] | None = None


@router.post("/save_weights_external")
def save_weights_external(body: SaveWeightsExternal, st: State, who: Owner) -> dict:
    """The adapter as a Hugging Face PEFT directory (adapter_config.json, adapter_model.safetensors), as
    tinker://{model_id}/external_weights/{name}: the native export_lora. age encryption is refused."""
    job = _save_job(body.path, st, body)
    if body.age_encryption_recipients:
        job = refused(InvalidInput("age encryption of exports is not supported by this server",
                                   field="age_encryption_recipients"))
    op = submit(st, who, body.model_id, body.seq_id, OperationKind.EXPORT_LORA, digest(body.model_dump()), job)
    return _saved(st, op, body, job)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(body: SaveWeights, st: State, who: Owner, ts: Tinker) -> dict:
    """A frozen sampler version: named (a tinker:// path comes back) or not (a sampling session comes back)."""
    job = _save_job(body.path, st, body)
    op = submit(st, who, body.model_id, body.seq_id, OperationKind.SAVE_WEIGHTS_FOR_SAMPLER,
                digest(body.model_dump()), job)
    if body.path is None:
        run = st.store.get_run(body.model_id, who)
        sampler_id = f"{body.model_id}:sampler:{body.seq_id}"
        with ts.lock:
            ts.samplers[sampler_id] = Sampler(who, run.base_model, op_id=op.id)
            ts.sampler_of_op[op.id] = sampler_id
    return _saved(st, op, body, job)


class LoadWeights(TinkerBody):
    path: str
    optimizer: bool = False
    model_id: str | None = None
    seq_id: int | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    base_model: str | None = None
    user_metadata: dict[str, Any] | None = None
    optimizer_config: dict[str, Any] | None = None
    weights_access_token: str | None = None


@router.post("/load_weights")
async def load_weights(body: LoadWeights, st: State, who: Owner) -> dict:
    """Into an existing model (model_id + seq_id: load_state in order), or a new model created from the
    checkpoint (session_id + model_seq_id: base model and LoRA config come from the checkpoint)."""
    kind = OperationKind.LOAD_STATE_WITH_OPTIMIZER if body.optimizer else OperationKind.LOAD_STATE
    if body.session_id is not None:
        if body.model_id is not None:
            raise InvalidInput("give model_id or session_id, not both", field="session_id")
        if body.model_seq_id is None:
            raise InvalidInput("session_id needs model_seq_id", field="model_seq_id")
        _check_optimizer(body.optimizer_config)
        run_id = model_id(body.session_id, body.model_seq_id)
        # Store reads (the key, the checkpoint, the run) on the thread pool, as every store call of these routes.
        also = await run_in_threadpool(access_owner, st, body.weights_access_token)
        package = await run_in_threadpool(resolve_path, st, who, body.path, also)
        if not await run_in_threadpool(_run_exists, st, who, run_id):
            await open_run(st, who, body.session_id, schemas.RunCreate(
                base_model=body.base_model, user_metadata=body.user_metadata or {},
                resume_from=schemas.ResumeFrom(checkpoint_id=package.id, with_optimizer=body.optimizer)), run_id,
                also)
        op = await run_in_threadpool(finished_op, st, who, kind,
                                     {"path": body.path, "model_id": run_id, "type": "load_weights"})
        return future(op, model_id=run_id)
    if body.model_id is None:
        raise InvalidInput("load_weights needs model_id (with seq_id) or session_id (with model_seq_id)",
                           field="model_id")
    op = await run_in_threadpool(_load_into, st, who, body, kind)
    return future(op, model_id=body.model_id)


def _load_into(st: ServiceState, who: str, body: LoadWeights, kind: OperationKind) -> OperationRecord:
    """load_state into the existing model body.model_id, in its seq_id order (store reads and an insert)."""
    try:
        package = resolve_path(st, who, body.path, access_owner(st, body.weights_access_token))
        if body.optimizer and not package.has_optimizer:
            raise InvalidInput("the checkpoint has no optimizer state; use load_state", field="path")
        job: Job = LoadJob(package.path, package.id)
    except WhitneyError as e:
        job = refused(e)
    return submit(st, who, body.model_id, body.seq_id, kind, digest(body.model_dump()), job)


def result(op: OperationRecord, st: ServiceState) -> dict:
    """A finished training operation's result as Tinker's JSON response for its kind."""
    r = op.result or {}
    saved = r.get("package") or {}  # the package a save wrote, as its result shows it
    if "tinker" in r:
        return r["tinker"]
    kind = op.kind
    if kind == OperationKind.OPTIM_STEP:
        return {"metrics": r.get("metrics") or {}}
    if kind == OperationKind.SAVE_STATE:
        return {"path": path_of(saved["run_id"], saved["kind"], saved["name"]), "type": "save_weights"}
    if kind == OperationKind.SAVE_WEIGHTS_FOR_SAMPLER:
        return {"path": path_of(saved["run_id"], saved["kind"], saved["name"]), "type": "save_weights_for_sampler"}
    if kind == OperationKind.EXPORT_LORA:
        try:
            size = packages.size_bytes(st.store.get_package(r["package"]["id"]))
        except WhitneyError:  # deleted or expired since
            size = None
        return {"path": path_of(saved["run_id"], saved["kind"], saved["name"]), "size_bytes": size,
                "type": "save_weights_external"}
    if kind in (OperationKind.LOAD_STATE, OperationKind.LOAD_STATE_WITH_OPTIMIZER):
        try:
            path = tinker_path(st.store.get_package(r["checkpoint_id"]))
        except WhitneyError:  # deleted since: the load happened all the same
            path = None
        return {"path": path, "model_id": op.run_id, "type": "load_weights"}
    return r
