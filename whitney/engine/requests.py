"""The plain data of a forward or forward_backward call, and its checks against a model's shape.

`ForwardRequest` goes in and `ForwardResult` comes out of `Engine.run_batch` and of every Backend;
`check_request` validates a request from the model's vocabulary and context alone (no weights), so a
backend whose engine lives in another process validates in the caller's.

Shape legend: N tokens of a datum, K soft targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from whitney.engine.datum import Datum, ImageInput, PreparedDatum, prepare_datum, to_tensor
from whitney.engine.loss_table import SCALAR, LossSpec, metric_reduction
from whitney.engine.losses import loss_spec
from whitney.errors import InvalidInput


@dataclass
class ForwardRequest:
    """One forward or forward_backward call: a run's datums and its loss. run_id None = the base model."""

    run_id: str | None
    data: list[Datum]
    loss_fn: str = "cross_entropy"
    loss_config: dict = field(default_factory=dict)
    base_model: str | None = None  # only when run_id is None
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


@dataclass
class CheckedRequest:
    """A request's datums as tensors (on the CPU), its loss's table entry and config (defaults filled),
    and per datum what the entry's check_row returned (opsd: its KL pairs; None without check_row)."""

    datums: list[PreparedDatum]
    spec: LossSpec
    config: dict
    rows: list[Any] | None = None


def check_request(request: ForwardRequest, backward: bool, vocab_size: int, max_context: int,
                  images=None) -> CheckedRequest:
    """Validate a request's run, loss, config and datums against a model's vocabulary and context; image chunks
    are expanded by `images` (vision.ImageExpander), or refused without it, and by a loss with a teacher stream."""
    if backward and request.run_id is None:
        raise InvalidInput("forward_backward needs a run", field="run_id")
    spec, config = loss_spec(request.loss_fn).configure(request.loss_config or {})
    if not isinstance(request.data, list) or not request.data:
        raise InvalidInput("data must be a non-empty list of datums", field="data")
    for i, d in enumerate(request.data):
        if spec.teacher and isinstance(getattr(d, "token_ids", None), (list, tuple)) and any(
                isinstance(c, ImageInput) for c in d.token_ids):
            raise InvalidInput(f"datum {i}: loss {request.loss_fn!r} takes text-only data, not image chunks",
                               field="model_input", datum_index=i)
    datums = [_prepare(d, i, spec, vocab_size, max_context, images) for i, d in enumerate(request.data)]
    shapes = [tuple(d.inputs["target_tokens"].shape[1:]) for d in datums]
    for i, s in enumerate(shapes):
        if s != shapes[0]:
            raise InvalidInput(f"datum {i}: target_tokens must be all [N] or all [N, K] with one K in a "
                               f"request; datum 0 has trailing shape {list(shapes[0])}, datum {i} has "
                               f"{list(s)}", field="target_tokens", datum_index=i)
    rows = [spec.check_row(d, i, config) for i, d in enumerate(datums)] if spec.check_row else None
    return CheckedRequest(datums, spec, config, rows)


def _prepare(datum: Datum, index: int, spec: LossSpec, vocab_size: int, max_context: int,
             images=None) -> PreparedDatum:
    """prepare_datum, and the entry's per-datum scalar inputs (rows SCALAR), each a finite 0-d float."""
    scalars = {k for k, f in spec.inputs.items() if f.rows == SCALAR}
    if not scalars:
        return prepare_datum(datum, index, spec.inputs, set(spec.required), vocab_size, max_context, images)
    given = dict(datum.loss_inputs or {}) if isinstance(datum.loss_inputs, dict) else {}
    values = {}
    for name in sorted(scalars):
        if name not in given:
            raise InvalidInput(f"datum {index}: loss input {name!r} is required", field=name, datum_index=index)
        t = to_tensor(given.pop(name), index, name)
        if t.numel() != 1 or t.dim() > 1 or t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise InvalidInput(f"datum {index}: {name} must be one finite number (shape [] or [1]), got shape "
                               f"{list(t.shape)}", field=name, datum_index=index)
        values[name] = t.reshape(()).float()
    rest = {k: f for k, f in spec.inputs.items() if k not in scalars}
    prepared = prepare_datum(Datum(datum.token_ids, given), index, rest, set(spec.required) - scalars,
                             vocab_size, max_context, images)
    prepared.inputs.update(values)
    return prepared
