"""Sampling and log-probs: not in seq_id order, and always on named, frozen weights."""

from __future__ import annotations

from pydantic import BaseModel

from whitney.errors import InvalidInput, NotFound, WhitneyError
from whitney.protocol.backend import PackageKind, Weights
from whitney.protocol.sampling import SamplingParams, validate
from whitney.service.api import images
from whitney.service.api.native import schemas
from whitney.service.cluster.payloads import SampleJob, ScoreJob
from whitney.service.http.deps import Owner, ServiceState, State, new_router
from whitney.service.http.heavy import run_checked
from whitney.service.scheduling.limits import check_operation, check_stops
from whitney.service.store.lifecycle import OPERATION_TERMINAL, RUN_OPEN, OperationKind
from whitney.service.store.packages import reading
from whitney.service.store.records import OperationRecord

router = new_router(prefix="/v1", tags=["sampling"])


def resolve(st: ServiceState, who: str, ref: schemas.WeightsRef) -> tuple[Weights, str]:
    """Backend weights for a reference (a run's sampler version, a checkpoint, or a base model), and its base.

    A run's versions are its sampler packages (save_weights_for_sampler registers each): a live run
    samples the version it holds in memory, an ended one the package on disk."""
    given = [k for k in ("run_id", "checkpoint_id", "base_model") if getattr(ref, k) is not None]
    if len(given) > 1:
        raise InvalidInput(f"name one source of weights, not {given}", field=given[1])
    if ref.run_id is not None:
        run = st.store.get_run(ref.run_id, who)
        if ref.version is None:
            raise InvalidInput("sampling a run needs a version from save_weights_for_sampler", field="version")
        # Checked now: a 404, not a queued operation that fails later.
        version = st.store.sampler_version(run.id, ref.version)
        if version is None:
            raise NotFound(f"run {ref.run_id!r} has no sampler version {ref.version}", field="version")
        if run.status in RUN_OPEN:  # the backend holds the run, and so the version, in memory
            return Weights(run_id=ref.run_id, version=ref.version), run.base_model
        if version.deleted:  # the run has ended and the version's package was deleted with it
            raise NotFound(f"run {ref.run_id!r} has no sampler version {ref.version}", field="version")
        return Weights(checkpoint_path=version.path), run.base_model
    if ref.version is not None:
        raise InvalidInput("version goes with run_id", field="version")
    if ref.checkpoint_id is not None:
        package = st.store.get_package(ref.checkpoint_id, who)
        if package.kind not in (PackageKind.STATE, PackageKind.SAMPLER):
            raise InvalidInput(f"checkpoint {package.id} is a {package.kind} export; sample from a saved "
                               "state or sampler version", field="checkpoint_id")
        return Weights(checkpoint_path=package.path), package.base_model
    base_model = ref.base_model or st.models[0]
    if not st.serves(base_model):
        raise InvalidInput(f"base model {base_model!r} is not served here; served: {st.models}", field="base_model")
    return Weights(base_model=base_model), base_model


@router.post("/samples", response_model=schemas.Operation, status_code=202)
def sample(body: schemas.SampleRequest, st: State, who: Owner):
    """Generate num_samples continuations of a prompt; poll the operation for the sequences."""
    params = SamplingParams(max_tokens=body.max_tokens, temperature=body.temperature, top_k=body.top_k,
                            top_p=body.top_p, seed=body.seed,
                            stop=None if body.stop is None else tuple(tuple(s) if isinstance(s, list) else s
                                                                      for s in body.stop),
                            num_samples=body.num_samples, prompt_logprobs=body.prompt_logprobs,
                            topk_prompt_logprobs=body.topk_prompt_logprobs, top_logprobs=body.topk_sample_logprobs,
                            prompt_logprobs_last_n=body.prompt_logprobs_last_n,
                            target_prompt_logprobs=None if body.target_prompt_logprobs is None else
                            tuple(tuple(r) for r in body.target_prompt_logprobs))
    _, base_model = resolve(st, who, body)  # first: a model without vision refuses images before any is read
    prompt = images.prompt(wire_input(body.prompt), "prompt", image_budget(st, base_model))
    process_images(st, who, base_model, prompt, "prompt")
    return start_sample(st, who, body, prompt, params)


def process_images(st: ServiceState, who: str, base_model: str, chunks: list, where: str) -> None:
    """A prompt's or sequence's images decoded and processed now (images.process_images, which sets their
    expected_tokens), as one of the key's heavy checks (http/heavy.py: a low CPU priority)."""
    if images.has_images(chunks):
        run_checked(st.quotas, who, 0, True, images.process_images, st.scheduler.backend, base_model, chunks, where)


def image_budget(st: ServiceState, base_model: str) -> images.ImageBudget:
    """One request's image budget, for `base_model` (a text model refuses images unread)."""
    return images.ImageBudget(st.limits, st.model_info(base_model), base_model)


def wire_input(tokens_or_chunks: list) -> list:
    """A prompt or sequence as parsed (token ids, or chunk models) as plain data (token ids, or chunk dicts)."""
    return [c.model_dump() if isinstance(c, BaseModel) else c for c in tokens_or_chunks]


def start_sample(st: ServiceState, who: str, ref: schemas.WeightsRef, prompt: list,
                 params: SamplingParams) -> OperationRecord:
    """Validate and queue one sampling operation; shared with the Tinker routes. `prompt`: token ids, or
    chunks (token lists and the engine's ImageInputs, checked by images.prompt and sized by process_images)."""
    check_stops(st.limits, params.stop)
    weights, base_model = resolve(st, who, ref)
    if images.has_images(prompt):
        images.refuse_images(st.model_info(base_model), base_model, "prompt")
    # A 400 now, not a failure later: an image stands as the positions its processing gave.
    info = st.model_info(base_model)
    validate(images.stand_in(prompt, info.max_context), params, info, st.scheduler.backend.config.max_sequences)
    # A 429 over the key's queued operations, counted in one step with the insert. A checkpoint read counts as its
    # reader until the operation ends: the TTL reaper waits (packages.py).
    op, _ = reading(st.store, weights.checkpoint_path, lambda: st.store.submit_operation(
        who, None, None, OperationKind.SAMPLE, "", admit=lambda conn: st.quotas.admit_operation(who, None, None, 0,
                                                                                              conn),
        payload=st.payload(SampleJob(prompt, params, weights))))
    st.scheduler.submit_sample(op, prompt, params, weights)
    return op


@router.post("/samples/{op_id}/cancel", response_model=schemas.Operation, status_code=202)
def cancel_sample(op_id: str, st: State, who: Owner):
    """Stop a sample: before the sampler's next decode step its rows leave the batch and its cache is freed, and
    the operation ends `cancelled` (poll it); one that ended first is left as it is. Answers the operation."""
    op = st.store.get_operation(op_id, who)
    if op.kind != OperationKind.SAMPLE:
        raise InvalidInput(f"operation {op_id!r} is a {op.kind}, not a sample: a run's operations end with its run "
                           "(POST /v1/runs/{run_id}/cancel)", field="op_id")
    if op.status not in OPERATION_TERMINAL:
        st.scheduler.cancel_sample(op.id, "cancelled by the client")
    return op


@router.post("/logprobs", response_model=schemas.Operation, status_code=202)
def compute_logprobs(body: schemas.LogprobsRequest, st: State, who: Owner):
    """Per-token log-probs of given sequences (the first position has none)."""
    weights, base_model = resolve(st, who, body)  # first: a model without vision refuses images before any is read
    budget = image_budget(st, base_model)
    sequences = []
    for i, s in enumerate(body.sequences):
        try:
            sequences.append(images.prompt(wire_input(s), f"sequences[{i}]", budget))
            process_images(st, who, base_model, sequences[-1], f"sequences[{i}]")
        except WhitneyError as e:
            e.datum_index = i
            raise
    lengths = [images.known_length(s) for s in sequences]  # an image counts its processed positions
    check_operation(st.limits, lengths, field="sequences")
    config = st.model_info(base_model)
    for i, seq in enumerate(sequences):
        if images.has_images(seq):
            images.refuse_images(config, base_model, f"sequences[{i}]")
        ids = images.token_ids(seq)
        if not seq or lengths[i] > config.max_context or not all(0 <= t < config.vocab_size for t in ids):
            raise InvalidInput(f"sequence {i} must hold 1 to {config.max_context} token ids in "
                               f"[0, {config.vocab_size})", field="sequences", datum_index=i)
    # A 429 over the key's quota, counted in one step with the insert. A checkpoint read counts as its reader until
    # the operation ends: the TTL reaper waits (packages.py).
    op, _ = reading(st.store, weights.checkpoint_path, lambda: st.store.submit_operation(
        who, None, None, OperationKind.COMPUTE_LOGPROBS, "",
        admit=lambda conn: st.quotas.admit_operation(who, None, None, sum(lengths), conn),
        payload=st.payload(ScoreJob(sequences, weights))))
    st.scheduler.submit_logprobs(op, sequences, weights)
    return op
