"""The plain data of training that crosses the boundary between the service and a backend: datums and their
tensors, a forward or forward_backward request and its result, a run's LoRA config, an optim_step's AdamW
hyperparameters. Torch-free: the control plane imports it without loading torch.

Shape legend: N tokens of a datum, K soft targets.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields

from whitney.errors import InvalidInput, check

# Soft targets: an [N, K] input has 1 <= K <= MAX_K candidates per position, so no tensor of a datum
# holds more than N * MAX_K values (a sparse tensor on the Tinker wire is made dense within that bound).
MAX_K = 256
MAX_DIMS = 2  # every loss input is [N], [N, K] or [M]


@dataclass
class TensorInput:
    """A dense tensor on the wire: dtype, shape and the values flattened in row-major order."""

    dtype: str
    shape: list[int]
    values: list


@dataclass
class ImageInput:
    """One image of a model input, as the service hands it to the engine: the encoded bytes (PNG or JPEG,
    already read from the request or from an allowed server-local path) and the number of positions the
    client expects it to take once the model's processor expands it (None: not checked)."""

    data: bytes
    format: str  # "png" | "jpeg"
    expected_tokens: int | None = None


# Two images need text between them: the models read a run of image placeholders as one image (Qwen's mrope grid,
# Gemma 3's bidirectional image block). The refusal of an image chunk right after another, wherever it is checked.
IMAGE_AFTER_IMAGE = "is an image right after another image; separate images with text (the model's image start " \
                    "and end tokens)"


@dataclass(frozen=True)
class Checked:
    """What Backend.validate found of a forward request, per datum D: its positions once its images are expanded,
    and its cost in positions' worth of engine work, which the scheduler shares out among runs: its positions,
    plus a custom loss's graph work (engine/losses/custom_run.py: WORK_PER_POSITION elements touched count as one
    position)."""

    positions_D: list[int]
    cost_D: list[int]


@dataclass
class Datum:
    # Flat token ids, or chunks concatenated in order: token chunks (lists of ids) and images.
    token_ids: list[int] | list[list[int] | ImageInput]
    loss_inputs: dict[str, TensorInput | list] = field(default_factory=dict)


@dataclass(frozen=True)
class LoraConfig:
    """What a run adapts and how. `target_modules`, when given, replaces the train_* flags."""

    rank: int = 32
    alpha: float = 32.0
    seed: int = 0
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True
    target_modules: tuple[str, ...] | None = None

    def to_dict(self) -> dict:
        out = asdict(self)
        out["target_modules"] = list(self.target_modules) if self.target_modules is not None else None
        return out

    @staticmethod
    def from_dict(d: dict) -> "LoraConfig":
        d = dict(d)
        if d.get("target_modules") is not None:
            d["target_modules"] = tuple(d["target_modules"])
        return LoraConfig(**d)


@dataclass(frozen=True)
class AdamParams:
    """Hyperparameters of one optim_step. Defaults are Tinker's."""

    learning_rate: float = 1e-4
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-12
    weight_decay: float = 0.0
    gradient_clip_norm: float = 0.0  # global L2 norm over the run's weights; 0 = off
    lora_plus_ratio: float = 1.0  # B matrices use learning_rate * lora_plus_ratio
    gradient_scale: float = 1.0  # multiplies the accumulated gradient once, before clipping

    @staticmethod
    def from_dict(d: dict) -> "AdamParams":
        names = {f.name for f in fields(AdamParams)}
        for key in d:
            if key not in names:
                raise InvalidInput(f"unknown optimizer parameter {key!r}; known: {sorted(names)}", field=key)
        params = AdamParams(**d)
        params.validate()
        return params

    def validate(self) -> None:
        def num(name: str, ok, rule: str) -> None:
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and ok(v),
                  f"{name} must be {rule}, got {v!r}", field=name)

        num("learning_rate", lambda v: v > 0, "positive and finite")
        num("beta1", lambda v: 0 <= v < 1, "in [0, 1)")
        num("beta2", lambda v: 0 <= v < 1, "in [0, 1)")
        num("eps", lambda v: v > 0, "positive")
        num("weight_decay", lambda v: v >= 0, "non-negative")
        num("gradient_clip_norm", lambda v: v >= 0, "non-negative (0 = off)")
        num("lora_plus_ratio", lambda v: v > 0, "positive")
        num("gradient_scale", lambda v: v > 0, "positive and finite")


# Every metric a loss reports is named "<name>:<reduction>", the form in which the Tinker SDK combines the
# results of one call's chunks (tinker/lib/chunked_fwdbwd_helpers.py splits each name at its one ":"):
# "sum" adds up over datums, micro-batches and chunks; "mean" is an average, merged here by what it averages
# over (`LossOutput.mean_counts`, else tokens: `merge_results` below) and by the SDK by datums per chunk.
METRIC_REDUCTIONS = ("sum", "mean")


def metric_reduction(name: str) -> str:
    """A metric's reduction, the part of its name after its one ':'; any other name is a bug of its loss."""
    base, _, how = name.partition(":")
    assert base and how in METRIC_REDUCTIONS, f"metric {name!r} is not named <name>:sum or <name>:mean"
    return how


@dataclass
class ForwardRequest:
    """One forward or forward_backward call: a run's datums and its loss. run_id None = the base model."""

    run_id: str | None
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_config: dict = field(default_factory=dict)
    base_model: str | None = None  # with no run; with one, only to validate it where the run is not held
    # forward_backward of one micro-batch of a larger operation: its gradient is added to the run's
    # staging area of this name, not to the accumulator (see Engine.commit_gradients).
    stage: str | None = None


@dataclass
class DatumOutput:
    logprobs: list[float]  # [N] learner log-prob per position (soft targets: weight-normalised mean)
    elementwise_loss: list[float]  # [N] per-position contribution to the loss


@dataclass
class ForwardResult:
    loss: float  # summed over tokens (opsd: summed over rows)
    metrics: dict[str, float]
    outputs: list[DatumOutput]
    mean_counts: dict[str, float] = field(default_factory=dict)  # see LossOutput.mean_counts


def merge_results(parts: list[ForwardResult]) -> ForwardResult:
    """The result of one request from the results of its micro-batches (consecutive datums, in order).

    Losses and `<name>:sum` metrics add up; a `<name>:mean` metric is weighted by what it averages over
    (its `mean_counts`, else the micro-batch's tokens), so the merge equals one pass. The reduction is the
    one a metric's name gives it (loss_table.metric_reduction).
    """
    if len(parts) == 1:
        return parts[0]
    metrics: dict[str, float] = {}
    counts: dict[str, float] = {}
    for part in parts:
        tokens = part.metrics.get("tokens:sum", float(sum(len(o.logprobs) for o in part.outputs)))
        for name, value in part.metrics.items():
            if metric_reduction(name) == "sum":
                metrics[name] = metrics.get(name, 0.0) + value
                continue
            weight = part.mean_counts.get(name, tokens)
            metrics[name] = metrics.get(name, 0.0) + value * weight
            counts[name] = counts.get(name, 0.0) + weight
    for name, weight in counts.items():
        metrics[name] = metrics[name] / weight if weight else 0.0
    return ForwardResult(sum(p.loss for p in parts), metrics, [o for p in parts for o in p.outputs], counts)
