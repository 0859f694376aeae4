"""Typed jobs: what an operation asks the backend to do, parked in the scheduler under its seq_id (datums in:
api/images.py `datums`; results out: results.py)."""

from __future__ import annotations

from dataclasses import dataclass

from whitney.protocol.backend import Failure
from whitney.protocol.training import AdamParams, Datum


@dataclass(frozen=True)
class ForwardJob:
    """forward / forward_backward: datums, a loss and its config; `lengths` are the datums' tokens (their positions,
    images expanded), `costs` what each is charged when the engine is shared out among runs (Checked.cost_D:
    positions, plus a custom loss's graph work; None: its lengths)."""

    data: list[Datum]
    loss_fn: str
    loss_config: dict
    lengths: list[int]
    costs: list[int] | None = None

    @property
    def shares(self) -> list[int]:
        return self.costs if self.costs is not None else self.lengths

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


@dataclass(frozen=True)
class OptimJob:
    params: AdamParams


@dataclass(frozen=True)
class SaveJob:
    """save_state, save_weights, export_lora or save_weights_for_sampler: a package by this name."""

    name: str | None = None
    include_optimizer: bool = True
    merge: bool = False


@dataclass(frozen=True)
class LoadJob:
    path: str
    checkpoint_id: str


@dataclass(frozen=True)
class Refused:
    """Refused when it arrived (Tinker calls hold their seq_id even then): it fails in its turn."""

    failure: Failure


Job = ForwardJob | OptimJob | SaveJob | LoadJob | Refused

