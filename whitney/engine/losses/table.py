"""What a loss is to the engine: one `LossSpec`, declared once, and the function contract they share.

The table itself is `losses.LOSSES` (every loss, opsd included); this module holds only the types and
the config parsing, so losses.py and opsd.py both build on it and neither imports the other's internals.

A `LossSpec` declares, for one loss name:
  inputs, required   its loss_inputs (`FieldSpec`: kind, rows, [N, K] allowed, default when absent)
  params             its loss_config keys, each a default and a rule (`Param`)
  resolve            cross-key rules, and the config the function reads, from the checked keys
  check_row          per-datum rules (after each field's shape check); what it returns is kept per datum
  check_datums       rules over all of a request's datums together (after check_row; custom: its work budget);
                     returns each datum's work beyond its positions (custom: its graph's), or None
  teacher            the input holding a teacher stream the engine runs through the same weights without
                     gradient (opsd); check_row then returns (student positions [K], teacher positions [K])
  tinker_defaults    values the Tinker protocol uses when a request names none of `params`
  bind               for a loss whose config is data rather than numbers (custom: a graph), what
                     `configure` does instead of `config`: the entry specialised to that config (its inputs)
  fn                 the loss

An input whose FieldSpec.rows is SCALAR ("datum") is one value per datum (shape [] or [1] on the wire),
given to fn as [B].

The function contract, for every loss: fn(lp, inputs, config) -> LossOutput, where
  lp      [N] or [N, K] learner log-probs of target_tokens, the request's datums concatenated
  inputs  the datums' N-row loss inputs, concatenated ([N] or [N, K]), and what the engine adds:
          datum_index [N] int64, the datum (0..B-1) each position belongs to; with a teacher pass also
          kl_index [P] (the position in [0, N) of each KL pair), student_kl [P, V] (learner
          full-vocabulary log-probs there) and teacher_kl [P, V] (the teacher's, no gradient)
  config  the parsed loss_config (`LossSpec.config`)
and the reduction is the loss's own, stated in its docstring (token sums; opsd sums per-row means).
Shape legend: N positions, K soft-target candidates, B datums, P KL pairs, V vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from whitney.engine.losses.datum import FieldSpec, PreparedDatum
from whitney.errors import InvalidInput, check

SCALAR = "datum"  # FieldSpec.rows of an input holding one value per datum


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, with the loss's own reduction
    elementwise: torch.Tensor  # [N] per-position contribution to the loss (detached)
    logprobs: torch.Tensor  # [N] per-position log-prob returned to the caller (detached)
    metrics: dict[str, float]
    # What each averaged metric is a mean over (default: the request's tokens), so the metrics of a
    # request's micro-batches merge into exactly the metrics of the whole (`protocol.training.merge_results`).
    mean_counts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Param:
    """One loss_config key: its default and the rule a given value must meet (`text` says it in words)."""

    default: float
    rule: Callable[[float], bool]
    text: str


@dataclass(frozen=True)
class LossSpec:
    name: str
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], dict], LossOutput]
    inputs: dict[str, FieldSpec]
    required: frozenset[str]
    params: dict[str, Param] = field(default_factory=dict)
    # (every key's value, defaults filled; the keys the request gave) -> the config fn reads. None: as is.
    resolve: Callable[[dict[str, float], set[str]], dict] | None = None
    check_row: Callable[[PreparedDatum, int, dict], Any] | None = None
    check_datums: Callable[[list[PreparedDatum], dict], list[int] | None] | None = None
    teacher: str | None = None
    tinker_defaults: dict[str, float] = field(default_factory=dict)
    bind: Callable[[dict], tuple[LossSpec, dict]] | None = None
    # dL/dlp for a loss linear in the log-probs (the same whatever their values: cross-entropy's is -weights),
    # from the inputs and config alone; the unembedding then takes the gradient in its forward pass
    # (unembedding.target_logprobs; a gradient that turns out different is recomputed, so this is speed only).
    gradient: Callable[[dict[str, torch.Tensor], dict], torch.Tensor] | None = None

    def configure(self, raw: dict) -> tuple[LossSpec, dict]:
        """The entry a request's loss_config makes of this one (itself, unless `bind` specialises it) and
        the parsed config (see `config`)."""
        if self.bind is not None:
            check(isinstance(raw, dict), "loss_config must be an object", field="loss_config")
            return self.bind(raw)
        return self, self.config(raw)

    def config(self, raw: dict) -> dict:
        """Validate a request's loss_config (unknown keys, non-finite or out-of-range values are
        InvalidInput naming `loss_config.<key>`), fill the defaults and resolve it."""
        check(isinstance(raw, dict), "loss_config must be an object", field="loss_config")
        for key in raw:
            check(key in self.params, f"loss_config.{key} is not a parameter of {self.name}; it takes "
                  f"{sorted(self.params) or 'none'}", field=f"loss_config.{key}")
        values = {}
        for key, param in self.params.items():
            value = raw.get(key, param.default)  # an explicit null is rejected like any other non-number
            check(finite(value) and param.rule(value), f"loss_config.{key} must be {param.text}, got {value!r}",
                  field=f"loss_config.{key}")
            values[key] = float(value)
        return self.resolve(values, set(raw)) if self.resolve else values

    def describe(self) -> dict:
        """The public part as plain data: inputs, config keys with defaults, extra passes."""
        return {"required_inputs": sorted(self.required),
                "optional_inputs": sorted(set(self.inputs) - self.required),
                "config": {key: p.default for key, p in self.params.items()},
                "passes": ["teacher"] if self.teacher else [],
                "tinker_defaults": dict(self.tinker_defaults)}


def finite(value) -> bool:
    """A finite int or float (not a bool). A JSON integer too large for a float is not finite."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def lookup(table: dict[str, LossSpec], name: str, unserved: dict[str, str]) -> LossSpec:
    """The entry of a loss by name; an unknown name is InvalidInput listing the known ones."""
    if name in table:
        return table[name]
    if name in unserved:
        raise InvalidInput(f"loss function {name!r} is not served: {unserved[name]}; served: {sorted(table)}",
                           field="loss_fn")
    raise InvalidInput(f"unknown loss function {name!r}; known: {sorted(table)}", field="loss_fn")
