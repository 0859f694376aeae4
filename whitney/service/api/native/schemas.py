"""Wire models of the native API. `extra="forbid"` everywhere: an unknown field is a 422, never dropped.

Request bodies are strict: a JSON `true` is not the integer 1, `"0"` is not 0, and a boolean is no
number (an integer is still a float). Every rule the server can state without knowing the model (ranges,
non-empty lists) is a Field constraint, so /openapi.json shows it and a breach is a 422 naming the field;
the model-dependent rules (vocabulary, context, max rank) stay with the engine's checks (400).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from whitney.service.store.lifecycle import OperationStatus, RunStatus, SessionStatus


class Wire(BaseModel):
    """A request body: unknown fields are refused, and no value is coerced to another JSON type."""

    model_config = ConfigDict(extra="forbid", strict=True)


# A 64-bit SQL integer is below 2**63: an exclusive bound, since 2**63 is exact as a float (FastAPI's OpenAPI
# model holds bounds as floats, where 2**63 - 1 would round up) and exact_integer_bounds writes it back as an integer.
INT64_LIMIT = 2**63
SeqId = Annotated[int, Field(ge=0, lt=INT64_LIMIT, description="the operation's place in the run")]
Seed = Annotated[int, Field(ge=0, lt=INT64_LIMIT)]
Rank = Annotated[int, Field(ge=1)]  # at most the server's max_lora_rank (capabilities): checked by the engine
TokenId = Annotated[int, Field(ge=0)]  # below the vocabulary size: checked against the model (400)
Tokens = Annotated[list[TokenId], Field(min_length=1)]


def exact_integer_bounds(app) -> None:
    """Make `app.openapi()` write the bounds of integer fields as JSON integers (`0`, `9223372036854775808`),
    not as the floats FastAPI's OpenAPI model turns them into (`0.0`, `9.223372036854776e+18`)."""
    generate = app.openapi

    def fix(node):
        if isinstance(node, dict):
            if node.get("type") == "integer":
                for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    if isinstance(node.get(key), float) and node[key].is_integer():
                        node[key] = int(node[key])
            for value in node.values():
                fix(value)
        elif isinstance(node, list):
            for value in node:
                fix(value)

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = generate()
            fix(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi


class Out(BaseModel):
    """A response: built from the store's records (read as attributes) or from dicts, showing only the declared
    fields."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)


class Error(Out):
    """Every 4xx body: a stable code, a message for people, and where known the field and datum at fault."""

    code: str
    message: str
    field: str | None = None
    datum_index: int | None = None
    errors: list[dict[str, Any]] | None = None  # 422 only: each schema violation (loc, msg, type)
    limit: int | None = None  # 429 only: the key's limit that was reached (field names it)
    usage: int | None = None  # 429 only: what the key holds against it


# ---- sessions and runs ---------------------------------------------------------------------

Label = Annotated[str, Field(min_length=1, max_length=256)]  # a tag, project id or display name


class SessionLabels(Wire):
    """Labels to find sessions by (GET /v1/sessions?tag=&project_id=&display_name=)."""

    tags: list[Label] | None = Field(None, max_length=64)
    project_id: Label | None = None
    display_name: Label | None = None


class SessionCreate(SessionLabels):
    user_metadata: dict[str, Any] = Field(default_factory=dict)


class Session(Out):
    id: str
    status: SessionStatus
    created_at: float
    last_heartbeat: float
    user_metadata: dict[str, Any]
    tags: list[str] | None = None
    project_id: str | None = None
    display_name: str | None = None


class LoraSpec(Wire):
    rank: Rank = 32
    alpha: float = Field(32.0, gt=0)
    seed: Seed = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    target_modules: list[str] | None = None


class ResumeFrom(Wire):
    checkpoint_id: str
    with_optimizer: bool = False


class RunCreate(Wire):
    base_model: str | None = None  # default: the server's first model
    lora: LoraSpec = Field(default_factory=LoraSpec)
    resume_from: ResumeFrom | None = None
    user_metadata: dict[str, Any] = Field(default_factory=dict)


class Run(Out):
    id: str
    session_id: str
    base_model: str
    lora: dict[str, Any]
    status: RunStatus
    created_at: float
    resume_from: str | None
    resume_with_optimizer: bool
    user_metadata: dict[str, Any]
    error: str | None


# ---- operations ----------------------------------------------------------------------------

class TensorData(Wire):
    dtype: Literal["int64", "int32", "float32", "float64"]
    shape: list[Annotated[int, Field(ge=0)]] | None = None
    values: list[float] | list[int]


class TextChunk(Wire):
    type: Literal["encoded_text"]
    tokens: Tokens


class ImageChunk(Wire):
    """An encoded image (service/images.py checks it against the limits and that it decodes)."""

    type: Literal["image"]
    data: str = Field(description="the PNG or JPEG bytes, base64")
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = Field(None, ge=1, description="positions the image should take once "
                                        "expanded by the model's processor; a different count is a 400")


class ImageAssetPointerChunk(Wire):
    """An image file on this server, under a directory the operator allowed (`whitney serve --image-dir`)."""

    type: Literal["image_asset_pointer"]
    location: str = Field(description="an absolute path or a file:// URI; network URLs are refused")
    format: Literal["png", "jpeg"]
    expected_tokens: int | None = Field(None, ge=1)


class OtherChunk(BaseModel):
    """Any other chunk type (audio: Tinker's dmel), shaped only so it can be refused with a 400 naming it."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: str = Field(json_schema_extra={"not": {"enum": ["encoded_text", "image", "image_asset_pointer"]}})


CHUNK_TYPES = ("encoded_text", "image", "image_asset_pointer")


def _chunk_tag(value: Any) -> str:
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in CHUNK_TYPES else "other"


Chunk = Annotated[Annotated[TextChunk, Tag("encoded_text")] | Annotated[ImageChunk, Tag("image")]
                  | Annotated[ImageAssetPointerChunk, Tag("image_asset_pointer")] | Annotated[OtherChunk, Tag("other")],
                  Discriminator(_chunk_tag)]
Chunks = Annotated[list[Chunk], Field(min_length=1)]


def _input_tag(value: Any) -> str:
    # Tags named as pydantic names list types, so an error's field path leaves them out (handlers.field_path).
    chunks = isinstance(value, list) and value and isinstance(value[0], (dict, BaseModel))
    return "list[Chunk]" if chunks else "list[int]"


# A prompt or scored sequence: token ids, or typed chunks (text and images).
TokensOrChunks = Annotated[Annotated[Tokens, Tag("list[int]")] | Annotated[Chunks, Tag("list[Chunk]")],
                           Discriminator(_input_tag)]


class ModelInput(Wire):
    """Exactly one of token_ids and chunks."""

    token_ids: Tokens | Annotated[list[Tokens], Field(min_length=1)] | None = None  # flat, or lists concatenated
    chunks: Chunks | None = None  # typed chunks: text, images, image asset pointers


class WireDatum(Wire):
    input: ModelInput
    loss_inputs: dict[str, TensorData] = Field(default_factory=dict)


class ForwardPayload(Wire):
    """The seed's ForwardPayload: datums, a loss name and its config."""

    seq_id: SeqId
    data: list[WireDatum] = Field(min_length=1)
    loss_function: str = "cross_entropy"
    loss_config: dict[str, Any] = Field(default_factory=dict)


class CustomLossInput(Wire):
    name: str
    rank: Literal[0, 1, 2]  # 0 one value per datum, 1 [N], 2 [N, K]


class CustomLossCreate(Wire):
    """A per-datum loss as a torch.fx graph in plain data (the Tinker SDK's CustomLossGraph); the engine's
    allow-list checks it (400 naming the node). Used as loss_function "custom", loss_config {"loss_id": id}."""

    name: str
    inputs: list[CustomLossInput] = Field(min_length=1)  # logprobs first, then the loss_inputs it reads
    graph: dict[str, Any]  # {format: 1, nodes: [{op, name, target, args, kwargs}]}


class CustomLoss(BaseModel):
    id: str
    name: str
    inputs: list[CustomLossInput]
    session_id: str | None = None
    created_at: float
    graph: dict[str, Any] | None = None  # only when read alone (GET /v1/custom_losses/{id})


class AdamSpec(Wire):
    """The ranges of protocol.training.AdamParams.validate (which also refuses infinities)."""

    learning_rate: float = Field(1e-4, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-12, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    gradient_clip_norm: float = Field(0.0, ge=0, description="0: no clipping")
    lora_plus_ratio: float = Field(1.0, gt=0)
    gradient_scale: float = Field(1.0, gt=0)


class OptimStep(Wire):
    seq_id: SeqId
    adam_params: AdamSpec = Field(default_factory=AdamSpec)


class SaveState(Wire):
    seq_id: SeqId
    name: str = Field(default="state", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    include_optimizer: bool = True


class LoadState(Wire):
    seq_id: SeqId
    checkpoint_id: str


class SaveWeights(Wire):
    seq_id: SeqId
    name: str = Field(default="weights", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    merge: bool = False


class ExportLora(Wire):
    seq_id: SeqId
    name: str = Field(default="lora", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")


class SaveForSampler(Wire):
    """The version number the result carries is the sampler version's name."""

    seq_id: SeqId


class Operation(Out):
    id: str
    run_id: str | None
    seq_id: int | None
    kind: str
    status: OperationStatus
    result: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: float
    started_at: float | None
    finished_at: float | None


# ---- sampling ------------------------------------------------------------------------------

class WeightsRef(Wire):
    """Which weights: a run's sampler version, a saved checkpoint, or a base model (exactly one)."""

    run_id: str | None = None
    version: int | None = None
    checkpoint_id: str | None = None
    base_model: str | None = None


class SampleRequest(WeightsRef):
    """The ranges of protocol.sampling.validate; the model-dependent ones (vocabulary, context) stay there."""

    prompt: TokensOrChunks
    num_samples: int = Field(1, ge=1)  # at most the server's max_concurrent_sequences
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0, description="0: greedy")
    top_k: int = Field(-1, ge=-1, description="-1: off")
    top_p: float = Field(1.0, gt=0, le=1)
    seed: Seed | None = None
    stop: list[Annotated[str, Field(min_length=1)] | TokenId | Tokens] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = Field(0, ge=0, le=100)  # engine.sampler.MAX_TOPK_PROMPT_LOGPROBS
    topk_sample_logprobs: int = Field(0, ge=0, le=100)  # each sequence's top_logprobs; the same bound
    prompt_logprobs_last_n: int | None = Field(None, ge=1)  # at most len(prompt) - 1 (protocol.sampling.validate)
    target_prompt_logprobs: list[list[int]] | None = None  # [len(prompt) - 1, K] ids, -1: none (engine.prompt_scores)


class LogprobsRequest(WeightsRef):
    sequences: list[TokensOrChunks] = Field(min_length=1)


# ---- model packages ------------------------------------------------------------------------

class Package(Out):
    id: str
    run_id: str
    kind: str
    name: str
    version: int
    base_model: str
    has_optimizer: bool
    created_at: float
    expires_at: float | None = None  # deleted by the server after this time (unix seconds); None: never
    public: bool = False  # readable (load, sample, download, copy) by every key; writable only by its owner
    user_metadata: dict[str, Any] | None = None


Ttl = Annotated[int, Field(ge=1, le=10 * 365 * 24 * 3600, description="seconds from now until the server deletes it")]


class PackageUpdate(Wire):
    """Fields left out stay as they are; `ttl_seconds: null` removes the expiry."""

    ttl_seconds: Ttl | None = None
    user_metadata: dict[str, Any] | None = None


class PackageCopy(Wire):
    """Copy into one of the caller's runs. A package of another key needs that key in X-Source-Key."""

    run_id: str
    name: str | None = Field(None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    ttl_seconds: Ttl | None = None


class PackageFiles(Out):
    """Download URLs of each file of a package, signed: a plain GET fetches one until `expires_at`."""

    urls: dict[str, str]
    expires_at: float


class Whoami(Out):
    key_id: str | None  # the key's id in `whitney keys list`; None for --api-key keys and servers without keys
    name: str | None
    owner: str  # the identity every row carries: the first 32 hex digits of the key's sha256 ('' without keys)


class TraceEvent(Out):
    """One operation: what, of which run, its status, and when it was queued, started and ended (unix seconds)."""

    operation_id: str
    kind: str
    run_id: str | None
    seq_id: int | None
    status: OperationStatus
    created_at: float
    started_at: float | None
    finished_at: float | None
    error_code: str | None
