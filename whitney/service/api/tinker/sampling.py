"""Tinker's sampling sessions and asample (compute_logprobs is an asample with prompt log-probs)."""

from __future__ import annotations

from typing import Any


from whitney.errors import InvalidInput, NotFound
from whitney.protocol.sampling import MAX_TOPK_PROMPT_LOGPROBS, SamplingParams
from whitney.service.api import images
from whitney.service.api.native import schemas
from whitney.service.api.native.sampling import process_images, resolve, start_sample
from whitney.service.api.tinker.common import Sampler, Tinker, TinkerBody, resolve_path, sampler_ref, served
from whitney.service.http.deps import Owner, State, new_router

router = new_router()


class CreateSamplingSession(TinkerBody):
    session_id: str
    sampling_session_seq_id: int
    base_model: str | None = None
    model_path: str | None = None


@router.post("/create_sampling_session")
def create_sampling_session(body: CreateSamplingSession, st: State, who: Owner, ts: Tinker) -> dict:
    st.store.get_session(body.session_id, who)
    if body.model_path is not None:
        base_model = resolve_path(st, who, body.model_path).base_model  # checked now: a 404, not a failed sample
    else:
        base_model = served(st, body.base_model)
    sampler_id = f"{body.session_id}:sample:{body.sampling_session_seq_id}"
    with ts.lock:
        ts.samplers[sampler_id] = Sampler(who, base_model, model_path=body.model_path)
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


def get_sampler(ts, sampler_id: str, who: str) -> Sampler:
    sampler = ts.samplers.get(sampler_id)
    if sampler is None or sampler.owner != who:
        raise NotFound(f"sampler {sampler_id!r} does not exist", field="sampling_session_id")
    return sampler


@router.get("/samplers/{sampler_id}")
def sampler_info(sampler_id: str, who: Owner, ts: Tinker) -> dict:
    sampler = get_sampler(ts, sampler_id, who)
    return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}


class Params(TinkerBody):
    max_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0


class Chunk(TinkerBody):
    """EncodedTextChunk, ImageChunk (data base64) or ImageAssetPointerChunk; any other type is a 400 naming it."""

    type: str = "encoded_text"
    tokens: list[int] | None = None
    data: str | None = None
    format: str | None = None
    location: str | None = None
    expected_tokens: int | None = None


class Prompt(TinkerBody):
    chunks: list[Chunk]


class ASample(TinkerBody):
    prompt: Prompt
    sampling_params: Params
    num_samples: int = 1
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: dict[str, Any] | None = None
    prompt_alt_tokens_k: int = 0
    prompt_logprobs_last_n: int | None = None
    record_stability_info: bool | None = None


def _unsupported(body: ASample) -> None:
    """Fields this server cannot honour are refused, never ignored."""
    for name, given in (("prompt_alt_tokens_k", body.prompt_alt_tokens_k),
                        ("record_stability_info", body.record_stability_info)):
        if given:
            raise InvalidInput(f"{name} is not supported by this server", field=name)


def _targets(tensor: dict[str, Any], prompt_len: int) -> tuple[tuple[int, ...], ...]:
    """The SDK's target_prompt_logprobs TensorData (int64 [P-1, K], dense or sparse CSR) as rows of ids,
    -1 in every cell a sparse tensor leaves out. The shape is checked before anything is made (P is at most
    the model's context, checked by the caller, so a sparse tensor expands to at most context x 100 cells);
    the ids by the engine."""
    field = "target_prompt_logprobs"
    data, shape = tensor.get("data"), tensor.get("shape")
    crow, col = tensor.get("sparse_crow_indices"), tensor.get("sparse_col_indices")
    if tensor.get("dtype") != "int64" or not isinstance(data, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in data):
        raise InvalidInput(f"{field} must be an int64 tensor of token ids", field=field)
    if not (isinstance(shape, list) and len(shape) == 2 and all(isinstance(d, int) for d in shape)
            and shape[0] == prompt_len - 1 and 1 <= shape[1] <= MAX_TOPK_PROMPT_LOGPROBS):
        raise InvalidInput(f"{field} must have shape [len(prompt) - 1 = {prompt_len - 1}, K] with K from 1 to "
                           f"{MAX_TOPK_PROMPT_LOGPROBS}, got {shape}", field=field)
    rows, width = shape
    if crow is None and col is None:
        if len(data) != rows * width:
            raise InvalidInput(f"{field}: {len(data)} values do not fill shape {shape}", field=field)
        return tuple(tuple(data[r * width:(r + 1) * width]) for r in range(rows))
    if not (isinstance(crow, list) and isinstance(col, list) and len(crow) == rows + 1 and crow[0] == 0
            and crow[-1] == len(data) == len(col) and all(a <= b for a, b in zip(crow, crow[1:]))
            and all(isinstance(c, int) and 0 <= c < width for c in col)):
        raise InvalidInput(f"{field}: sparse CSR indices do not match shape {shape} and {len(data)} values",
                           field=field)
    out = [[-1] * width for _ in range(rows)]
    for r in range(rows):
        for i in range(crow[r], crow[r + 1]):
            out[r][col[i]] = data[i]
    return tuple(tuple(row) for row in out)


def _chunk(chunk: Chunk, index: int) -> dict:
    """A prompt chunk as the native chunk dict service/images.py reads (each type's fields required)."""
    where = f"prompt.chunks[{index}]"
    needs = {"encoded_text": ("tokens",), "image": ("data", "format"), "image_asset_pointer": ("location", "format")}
    for name in needs.get(chunk.type, ()):
        if getattr(chunk, name) is None:
            raise InvalidInput(f"{where}: a {chunk.type} chunk needs {name}", field=f"{where}.{name}")
    if chunk.type == "encoded_text" and not all(isinstance(t, int) and t >= 0 for t in chunk.tokens):
        raise InvalidInput(f"{where}.tokens must be token ids", field=f"{where}.tokens")
    return chunk.model_dump()


@router.post("/asample")
def asample(body: ASample, st: State, who: Owner, ts: Tinker) -> dict:
    _unsupported(body)
    if body.sampling_session_id is not None:
        ref = sampler_ref(st, get_sampler(ts, body.sampling_session_id, who))
    elif body.model_path is not None:
        ref = schemas.WeightsRef(checkpoint_id=resolve_path(st, who, body.model_path).id)
    else:
        ref = schemas.WeightsRef(base_model=served(st, body.base_model))
    _, base_model = resolve(st, who, ref)  # first: a model without vision refuses images before any is read
    info = st.model_info(base_model)
    prompt = images.prompt([_chunk(c, j) for j, c in enumerate(body.prompt.chunks)], "prompt.chunks",
                           images.ImageBudget(st.limits, info, base_model)) if body.prompt.chunks else []
    process_images(st, who, base_model, prompt, "prompt.chunks")  # each image's expected_tokens: its positions
    last_n = body.prompt_logprobs_last_n
    if not 0 <= body.topk_sample_logprobs <= MAX_TOPK_PROMPT_LOGPROBS:  # the engine names it top_logprobs
        raise InvalidInput(f"topk_sample_logprobs must be from 0 to {MAX_TOPK_PROMPT_LOGPROBS}",
                           field="topk_sample_logprobs")
    if last_n is not None and not body.prompt_logprobs:  # as the SDK documents; its range is the engine's check
        raise InvalidInput("prompt_logprobs_last_n needs prompt_logprobs", field="prompt_logprobs_last_n")
    p = body.sampling_params
    stop = None if p.stop is None else (p.stop,) if isinstance(p.stop, str) else tuple(p.stop)
    max_tokens = p.max_tokens
    length = images.known_length(prompt)  # an image counts its processed positions
    images.check_context(length, info.max_context, "prompt.chunks")  # before target rows are made from it
    if max_tokens is None:  # until a stop or the end of the context
        max_tokens = info.max_context - length
    params = SamplingParams(max_tokens=max_tokens, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                            seed=p.seed, stop=stop, num_samples=body.num_samples,
                            prompt_logprobs=bool(body.prompt_logprobs),
                            topk_prompt_logprobs=body.topk_prompt_logprobs, top_logprobs=body.topk_sample_logprobs,
                            prompt_logprobs_last_n=last_n, target_prompt_logprobs=None if
                            body.target_prompt_logprobs is None else _targets(body.target_prompt_logprobs, length))
    op = start_sample(st, who, ref, prompt, params)
    return {"request_id": op.id, "sample_sequence_ids": [f"{op.id}:{i}" for i in range(body.num_samples)]}
