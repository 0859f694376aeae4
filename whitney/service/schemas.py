"""Wire models of the native API. `extra="forbid"` everywhere: an unknown field is a 422, never dropped."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt


class Wire(BaseModel):
    """A request body: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class Out(BaseModel):
    """A response: built from store rows, showing only the declared fields."""

    model_config = ConfigDict(extra="ignore")


class Error(Out):
    """Every 4xx body: a stable code, a message for people, and where known the field and datum at fault."""

    code: str
    message: str
    field: str | None = None
    datum_index: int | None = None
    errors: list[dict[str, Any]] | None = None  # 422 only: each schema violation (loc, msg, type)


# ---- sessions and runs ---------------------------------------------------------------------

class SessionCreate(Wire):
    user_metadata: dict[str, Any] = Field(default_factory=dict)


class Session(Out):
    id: str
    status: Literal["active", "closed", "expired"]
    created_at: float
    last_heartbeat: float
    user_metadata: dict[str, Any]


class LoraSpec(Wire):
    rank: int = 32
    alpha: float = 32.0
    seed: int = 0
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
    status: str
    created_at: float
    resume_from: str | None
    resume_with_optimizer: bool
    user_metadata: dict[str, Any]
    error: str | None


# ---- operations ----------------------------------------------------------------------------

class TensorData(Wire):
    dtype: Literal["int64", "int32", "float32", "float64"]
    shape: list[int] | None = None
    values: list[float] | list[int]


class ModelInput(Wire):
    token_ids: list[StrictInt] | list[list[StrictInt]]  # strict: true is not token 1


class WireDatum(Wire):
    input: ModelInput
    loss_inputs: dict[str, TensorData] = Field(default_factory=dict)


class ForwardPayload(Wire):
    """The seed's ForwardPayload: datums, a loss name and its config."""

    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer
    data: list[WireDatum] = Field(min_length=1)
    loss_function: str = "cross_entropy"
    loss_config: dict[str, Any] = Field(default_factory=dict)


class AdamSpec(Wire):
    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    gradient_clip_norm: float = 0.0
    lora_plus_ratio: float = 1.0
    gradient_scale: float = 1.0


class OptimStep(Wire):
    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer
    adam_params: AdamSpec = Field(default_factory=AdamSpec)


class SaveState(Wire):
    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer
    name: str = Field(default="state", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    include_optimizer: bool = True


class LoadState(Wire):
    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer
    checkpoint_id: str


class SaveWeights(Wire):
    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer
    name: str = Field(default="weights", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")
    merge: bool = False


class ExportLora(Wire):
    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer
    name: str = Field(default="lora", min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._-]+$")


class SaveForSampler(Wire):
    """The version number the result carries is the sampler version's name."""

    seq_id: int = Field(ge=0, lt=2**63)  # a 64-bit SQL integer


class Operation(Out):
    id: str
    run_id: str | None
    seq_id: int | None
    kind: str
    status: Literal["queued", "running", "succeeded", "failed", "cancelled"]
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
    prompt: list[StrictInt]
    num_samples: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str | int | list[int]] | None = None
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


class LogprobsRequest(WeightsRef):
    sequences: list[list[StrictInt]] = Field(min_length=1)


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
