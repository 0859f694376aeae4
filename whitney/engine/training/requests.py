"""The plain data of a forward or forward_backward call, and its checks against a model's shape.

`ForwardRequest` goes in and `ForwardResult` comes out of `Engine.run_batch` and of every Backend;
`check_request` validates a request from the model's vocabulary and context alone (no weights), so a
backend whose engine lives in another process validates in the caller's.

Shape legend: N tokens of a datum, K soft targets.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from whitney.engine.losses.builtin import loss_spec
from whitney.engine.losses.datum import PreparedDatum, prepare_datum, to_tensor
from whitney.engine.losses.table import SCALAR, LossSpec
from whitney.errors import InvalidInput
from whitney.engine.losses.custom_run import positions_worth
from whitney.protocol.training import Checked, Datum, ForwardRequest, ImageInput


@dataclass
class CheckedRequest:
    """A request's datums as tensors (on the CPU), its loss's table entry and config (defaults filled),
    and per datum what the entry's check_row returned (opsd: its KL pairs; None without check_row) and the
    engine work its loss does beyond its positions (a custom loss's graph; None: none)."""

    datums: list[PreparedDatum]
    spec: LossSpec
    config: dict
    rows: list[Any] | None = None
    work: list[int] | None = None

    def checked(self) -> Checked:
        """As the Backend answers validate: each datum's positions, and its cost (custom_run.positions_worth)."""
        positions = [d.length for d in self.datums]
        extra = self.work or [0] * len(positions)
        return Checked(positions, [n + positions_worth(w) for n, w in zip(positions, extra)])


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
    work = spec.check_datums(datums, config) if spec.check_datums else None
    return CheckedRequest(datums, spec, config, rows, work)


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
