"""Typed jobs: what an operation asks the backend to do, parked in the scheduler under its seq_id; and
the conversions of the backend's results to the wire's plain data (datums in: service/images.py `datums`)."""

from __future__ import annotations

from dataclasses import dataclass

from whitney.protocol.backend import Failure
from whitney.protocol.training import AdamParams, Datum


@dataclass(frozen=True)
class ForwardJob:
    """forward / forward_backward: datums, a loss and its config; `lengths` are the datums' tokens."""

    data: list[Datum]
    loss_fn: str
    loss_config: dict
    lengths: list[int]

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


def public_package(package: dict) -> dict:
    """A package as clients see it: no owner digest, no server path."""
    return {k: v for k, v in package.items() if k not in ("owner", "path", "deleted", "readers")}


def forward_result_dict(result) -> dict:
    return {
        "loss": result.loss,
        "metrics": result.metrics,
        "outputs": [{"logprobs": o.logprobs, "elementwise_loss": o.elementwise_loss} for o in result.outputs],
    }


def sample_result_dict(result) -> dict:
    return {
        "sequences": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                      for s in result.sequences],
        "prompt_logprobs": result.prompt_logprobs,
        "topk_prompt_logprobs": result.topk_prompt_logprobs,
        "target_prompt_logprobs": result.target_prompt_logprobs,
    }
