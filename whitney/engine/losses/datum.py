"""Datums: plain lists in, validated tensors out.

A datum is one sequence: input token ids (a list of chunks is concatenated; an image chunk becomes the
model's placeholder positions, engine/vision.py) and named per-token tensors (`loss_inputs`). Every field
is checked against the (expanded) input length N before any compute, and a bad one raises an error naming
the datum index, the field, the expected and the actual shape.

Shapes: N input tokens of the datum; K candidates per position (soft targets); M teacher tokens (opsd).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from whitney.errors import InvalidInput
from whitney.protocol.training import MAX_DIMS, MAX_K, Datum, ImageInput, TensorInput

INT_DTYPES = ("int64", "int32")
FLOAT_DTYPES = ("float32", "float64")
# Tinker's name for the sampler's log-probs.
ALIASES = {"logprobs": "old_logprobs"}


@dataclass(frozen=True)
class FieldSpec:
    """How one loss input must look. `rows` is 'N' (input length) or a field holding another stream."""

    kind: str  # "int" | "float" | "mask" | "token"
    rows: str = "N"
    allow_2d: bool = False
    default: float | None = None  # value when absent, shaped like target_tokens


@dataclass
class PreparedDatum:
    """A validated datum: tokens [N] int64 and loss inputs as tensors ([N], [N, K] or [M]), on the CPU
    (validation reads values; the engine moves what it computes with to its device)."""

    tokens: torch.Tensor
    inputs: dict[str, torch.Tensor]
    images: list = field(default_factory=list)  # vision.ProcessedImage per image chunk, in position order

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def _flatten_tokens(token_ids: Any, index: int) -> list[int]:
    if not isinstance(token_ids, (list, tuple)):
        raise InvalidInput(f"datum {index}: token_ids must be a list of ints or of chunks",
                           field="token_ids", datum_index=index)
    if any(isinstance(c, ImageInput) for c in token_ids):
        raise InvalidInput(f"datum {index}: this base model takes no images", field="model_input", datum_index=index)
    if token_ids and all(isinstance(c, (list, tuple)) for c in token_ids):
        return [t for chunk in token_ids for t in chunk]
    return list(token_ids)


def _check_tokens(values: torch.Tensor, vocab: int, index: int, name: str) -> None:
    bad = (values < 0) | (values >= vocab)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0][0]) if values.dim() == 1 else tuple(bad.nonzero()[0].tolist())
        raise InvalidInput(f"datum {index}: {name} has token id {int(values[bad][0])} at position {pos}, "
                           f"outside the vocabulary [0, {vocab})", field=name, datum_index=index)


def to_tensor(value: TensorInput | list | dict, index: int, name: str) -> torch.Tensor:
    """A wire tensor (TensorInput, {dtype, shape, values} dict, or nested list) as a torch tensor."""
    if isinstance(value, dict):
        unknown = set(value) - {"dtype", "shape", "values"}
        if unknown or "values" not in value:
            raise InvalidInput(f"datum {index}: {name} must be {{dtype, shape, values}}, got keys {sorted(value)}",
                               field=name, datum_index=index)
        value = TensorInput(value.get("dtype", "float32"), value.get("shape"), value["values"])
    if isinstance(value, TensorInput):
        if value.dtype not in INT_DTYPES + FLOAT_DTYPES:
            raise InvalidInput(f"datum {index}: {name} has dtype {value.dtype!r}; expected one of "
                               f"{INT_DTYPES + FLOAT_DTYPES}", field=name, datum_index=index)
        dtype = torch.int64 if value.dtype in INT_DTYPES else torch.float64
        if dtype == torch.int64 and isinstance(value.values, list) and any(
                isinstance(v, float) and not v.is_integer() for v in value.values):
            # torch.tensor would truncate 12.5 to 12 silently.
            raise InvalidInput(f"datum {index}: {name} has dtype {value.dtype} but non-integer values",
                               field=name, datum_index=index)
        try:
            t = torch.tensor(value.values, dtype=dtype, device="cpu")
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise InvalidInput(f"datum {index}: {name} values must be a flat list of {value.dtype} numbers",
                               field=name, datum_index=index) from None
        shape = value.shape if value.shape is not None else [t.numel()]
        if (not isinstance(shape, (list, tuple)) or len(shape) > MAX_DIMS
                or not all(isinstance(s, int) and s >= 0 for s in shape)
                or t.dim() != 1 or math.prod(shape) != t.numel()):
            raise InvalidInput(f"datum {index}: {name} has {t.numel()} values, which do not fill shape "
                               f"{list(shape) if isinstance(shape, (list, tuple)) else shape} (at most "
                               f"{MAX_DIMS} non-negative dimensions)",
                               field=name, datum_index=index)
        return t.reshape(shape)
    try:
        t = torch.tensor(value, device="cpu")
    except (TypeError, ValueError, RuntimeError, OverflowError):
        raise InvalidInput(f"datum {index}: {name} must be a rectangular list of numbers",
                           field=name, datum_index=index) from None
    return t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)


def prepare_datum(datum: Datum, index: int, specs: dict[str, FieldSpec], required: set[str],
                  vocab: int, max_length: int, images=None) -> PreparedDatum:
    """Validate one datum for a loss whose inputs are `specs` (of which `required` must be present). `images`
    (engine/vision.py ImageExpander) expands image chunks into the model's placeholder positions; every loss
    input is then aligned to the expanded length N. Without it an image chunk is refused."""
    if images is not None and isinstance(datum.token_ids, (list, tuple)):
        flat, processed = images.flatten(datum.token_ids, index)
    else:
        flat, processed = _flatten_tokens(datum.token_ids, index), []
    if len(flat) == 0:
        raise InvalidInput(f"datum {index}: token_ids is empty", field="token_ids", datum_index=index)
    if len(flat) > max_length:
        raise InvalidInput(f"datum {index}: {len(flat)} tokens exceed the model's context of {max_length}",
                           field="token_ids", datum_index=index)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in flat):
        raise InvalidInput(f"datum {index}: token_ids must be integers", field="token_ids", datum_index=index)
    # Checked on the ints, before torch: an id beyond int64 would fail to convert (a 500, not a 400).
    bad = next((pos for pos, t in enumerate(flat) if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidInput(f"datum {index}: token_ids has token id {flat[bad]} at position {bad}, "
                           f"outside the vocabulary [0, {vocab})", field="token_ids", datum_index=index)
    tokens = torch.tensor(flat, dtype=torch.int64, device="cpu")
    n = tokens.shape[0]

    raw, given = {}, {}
    for name, value in (datum.loss_inputs or {}).items():
        canon = ALIASES.get(name, name)
        if canon in raw:
            raise InvalidInput(f"datum {index}: both {given[canon]!r} and {name!r} are given; they are "
                               f"the same input {canon!r}", field=name, datum_index=index)
        given[canon] = name
        if canon not in specs:
            raise InvalidInput(f"datum {index}: loss input {name!r} is not used by this loss; it takes "
                               f"{sorted(specs)}", field=name, datum_index=index)
        raw[canon] = to_tensor(value, index, name)
    for name in sorted(required - set(raw)):
        raise InvalidInput(f"datum {index}: loss input {name!r} is required", field=name, datum_index=index)

    inputs: dict[str, torch.Tensor] = {}
    # Fields sized by another stream (the opsd teacher) come after the field that defines it.
    for name in sorted(raw, key=lambda k: 0 if specs[k].rows == "N" else 1 if specs[k].rows == k else 2):
        spec, t = specs[name], raw[name]
        rows = n if spec.rows == "N" else int(inputs[spec.rows].shape[0]) if spec.rows in inputs else None
        if rows is None and name != spec.rows:  # a field defining its own stream is sized just below
            raise InvalidInput(f"datum {index}: {name} needs {spec.rows}", field=spec.rows, datum_index=index)
        if spec.kind == "token" and name == spec.rows:  # a stream of its own: any non-zero length
            rows = t.shape[0] if t.dim() == 1 else -1
            if t.dim() == 1 and rows == 0:
                raise InvalidInput(f"datum {index}: {name} is empty", field=name, datum_index=index)
            if rows > max_length:
                raise InvalidInput(f"datum {index}: {name} has {rows} tokens, over the context of {max_length}",
                                   field=name, datum_index=index)
        ok_1d = t.dim() == 1 and t.shape[0] == rows
        ok_2d = spec.allow_2d and t.dim() == 2 and t.shape[0] == rows and 1 <= t.shape[1] <= MAX_K
        if not (ok_1d or ok_2d):
            expected = f"[{rows}]" + (f" or [{rows}, K] with 1 <= K <= {MAX_K}" if spec.allow_2d else "")
            raise InvalidInput(f"datum {index}: {name} has shape {list(t.shape)}, expected {expected}",
                               field=name, datum_index=index)
        if spec.kind in ("int", "token"):
            if t.is_floating_point():
                raise InvalidInput(f"datum {index}: {name} must be int64, got floating-point values",
                                   field=name, datum_index=index)
            if spec.kind == "token":
                _check_tokens(t, vocab, index, name)
        else:
            t = t.double()
            if not bool(torch.isfinite(t).all()):
                raise InvalidInput(f"datum {index}: {name} contains NaN or infinite values",
                                   field=name, datum_index=index)
            if spec.kind == "mask" and not bool(((t == 0) | (t == 1)).all()):
                raise InvalidInput(f"datum {index}: {name} must hold only 0 and 1", field=name, datum_index=index)
            t = t.float()
        inputs[name] = t
    for name, spec in specs.items():
        if name not in inputs and spec.default is not None:
            inputs[name] = torch.full(inputs["target_tokens"].shape, spec.default, device="cpu")
    # A soft target's weights must match its candidates.
    if "weights" in inputs and "target_tokens" in inputs and inputs["weights"].shape != inputs["target_tokens"].shape:
        raise InvalidInput(f"datum {index}: weights has shape {list(inputs['weights'].shape)}, expected "
                           f"{list(inputs['target_tokens'].shape)} like target_tokens",
                           field="weights", datum_index=index)
    return PreparedDatum(tokens, inputs, processed)
