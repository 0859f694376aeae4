"""Token-summed losses, one plain function each, and the map from names to them.

Each loss takes the learner's log-probs of the targets and the datum's tensors, concatenated over the
datums of one request (the sums make that equivalent to per-datum calls), and returns the loss
**summed over tokens, never averaged**, the per-token loss and detached metrics.

Notation: l_t learner log-prob of the target, q_t sampler log-prob (`old_logprobs`), r_t = exp(l_t - q_t),
A_t advantage, w_t weight, sg = stop-gradient. Shapes: N tokens, K soft-target candidates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from whitney.engine.datum import FieldSpec
from whitney.errors import InvalidInput, check


# Each loss's loss_config keys, as the capabilities route advertises them.
LOSS_CONFIG_KEYS = {
    "cross_entropy": (),
    "importance_sampling": (),
    "ppo": ("clip_low", "clip_high", "clip_low_threshold", "clip_high_threshold"),
    "cispo": ("eps_max", "clip_low_threshold", "clip_high_threshold"),
    "dro": ("beta",),
    "opsd": ("ce_coef", "kl_coef"),
}


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar, summed over tokens
    elementwise: torch.Tensor  # [N] per-token loss (detached)
    logprobs: torch.Tensor  # [N] per-position log-prob returned to the caller (detached)
    metrics: dict[str, float]
    # What each averaged metric is a mean over (default: the request's tokens), so the metrics of a
    # request's micro-batches merge into exactly the metrics of the whole (`runs.merge_results`).
    mean_counts: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[torch.Tensor, dict[str, torch.Tensor], dict], LossOutput] | None
    inputs: dict[str, FieldSpec]
    required: frozenset[str]
    config: Callable[[dict], dict]  # validates a loss_config and fills defaults


def _metrics(loss: torch.Tensor, n: int, **extra: float) -> dict[str, float]:
    return {"loss:sum": float(loss.detach()), "tokens:sum": float(n), **extra}


def cross_entropy(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """L = -sum_t w_t l_t for targets [N]; L = -sum_t sum_k w_tk log p(x_tk) for targets [N, K].

    Weights default to 1 and may be any real value, negative included. With [N, K] targets the
    returned per-position log-prob is the weight-normalised mean over the K candidates.
    """
    w = inputs["weights"]  # [N] or [N, K], default 1
    per_token = -(w * lp)
    if lp.dim() == 2:
        per_token = per_token.sum(-1)  # [N]
        wsum = w.sum(-1, keepdim=True)
        safe = torch.where(wsum == 0, torch.ones_like(wsum), wsum)
        shown = torch.where(wsum[:, 0] == 0, lp.mean(-1), (w * lp).sum(-1) / safe[:, 0])
    else:
        shown = lp
    loss = per_token.sum()
    return LossOutput(loss, per_token.detach(), shown.detach(), _metrics(loss, lp.shape[0]))


def importance_sampling(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """L = -sum_t r_t A_t, r_t = exp(l_t - q_t). Unclipped off-policy policy gradient."""
    ratio = torch.exp(lp - inputs["old_logprobs"])
    per_token = -ratio * inputs["advantages"]
    loss = per_token.sum()
    return LossOutput(loss, per_token.detach(), lp.detach(),
                      _metrics(loss, lp.shape[0], **{"ratio:mean": float(ratio.detach().mean())}))


def ppo(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """L = -sum_t min(r_t A_t, clip(r_t, low, high) A_t) with absolute bounds low, high."""
    adv = inputs["advantages"]
    ratio = torch.exp(lp - inputs["old_logprobs"])
    clipped = torch.clamp(ratio, config["low"], config["high"])
    per_token = -torch.minimum(ratio * adv, clipped * adv)
    loss = per_token.sum()
    frac = float(((ratio * adv) > (clipped * adv)).float().mean()) if lp.numel() else 0.0
    return LossOutput(loss, per_token.detach(), lp.detach(),
                      _metrics(loss, lp.shape[0], **{"clipped_fraction:mean": frac}))


def cispo(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """L = -sum_t sg(clip(r_t, low, high)) A_t l_t: the ratio is capped, the gradient flows through l_t.

    With `eps_max` the bounds are (0, eps_max]: sg(min(r_t, eps_max)).
    """
    ratio = torch.exp(lp.detach() - inputs["old_logprobs"])
    capped = torch.clamp(ratio, config["low"], config["high"])
    per_token = -capped * inputs["advantages"] * lp
    loss = per_token.sum()
    frac = float((capped != ratio).float().mean()) if lp.numel() else 0.0
    return LossOutput(loss, per_token.detach(), lp.detach(),
                      _metrics(loss, lp.shape[0], **{"clipped_fraction:mean": frac}))


def dro(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """L = -sum_t [l_t A_t - (beta / 2) (l_t - q_t)^2]: reward with a quadratic anchor to the sampler."""
    beta = config["beta"]
    per_token = -(lp * inputs["advantages"] - 0.5 * beta * (lp - inputs["old_logprobs"]) ** 2)
    loss = per_token.sum()
    return LossOutput(loss, per_token.detach(), lp.detach(), _metrics(loss, lp.shape[0]))


def _finite(value) -> bool:
    """A finite int or float (not a bool). A JSON integer too large for a float is not finite."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def _number(config: dict, key: str, default: float, rule: Callable[[float], bool], text: str) -> float:
    value = config.get(key, default)  # an explicit null is rejected like any other non-number
    check(_finite(value) and rule(value), f"loss_config.{key} must be {text}, got {value!r}",
          field=f"loss_config.{key}")
    return float(value)


def check_config_keys(config: dict, loss: str) -> None:
    check(isinstance(config, dict), "loss_config must be an object", field="loss_config")
    keys = LOSS_CONFIG_KEYS[loss]
    for key in config:
        check(key in keys, f"loss_config.{key} is not a parameter of {loss}; it takes {sorted(keys) or 'none'}",
              field=f"loss_config.{key}")


def _no_config(name: str) -> Callable[[dict], dict]:
    def parse(config: dict) -> dict:
        check_config_keys(config, name)
        return {}
    return parse


def _ratio_bounds(config: dict, loss: str, other_form: tuple[str, ...], default_low: float,
                  default_high: float) -> dict:
    """Tinker's absolute bounds {low, high} when a *_threshold key is given, else {}; never both forms."""
    absolute = {"clip_low_threshold", "clip_high_threshold"} & set(config)
    other = set(other_form) & set(config)
    check(not (absolute and other), f"{loss}: give either {sorted(other_form)} or "
          "clip_low_threshold/clip_high_threshold, not both", field=f"loss_config.{min(absolute or {''})}")
    if not absolute:
        return {}
    low = _number(config, "clip_low_threshold", default_low, lambda v: 0 <= v <= 1, "in [0, 1]")
    high = _number(config, "clip_high_threshold", default_high, lambda v: v >= 1, ">= 1")
    return {"low": low, "high": high}


def _ppo_config(config: dict) -> dict:
    check_config_keys(config, "ppo")
    bounds = _ratio_bounds(config, "ppo", ("clip_low", "clip_high"), 0.8, 1.2)
    if bounds:
        return bounds
    low = _number(config, "clip_low", 0.2, lambda v: 0 <= v <= 1, "in [0, 1]")
    high = _number(config, "clip_high", 0.2, lambda v: v >= 0, ">= 0")
    return {"low": 1.0 - low, "high": 1.0 + high}


CISPO_DEFAULT_EPS_MAX = 5.0


def _cispo_config(config: dict) -> dict:
    check_config_keys(config, "cispo")
    bounds = _ratio_bounds(config, "cispo", ("eps_max",), 0.8, 1.2)
    if bounds:
        return bounds
    return {"low": 0.0, "high": _number(config, "eps_max", CISPO_DEFAULT_EPS_MAX, lambda v: v > 0, "> 0")}


def _dro_config(config: dict) -> dict:
    check_config_keys(config, "dro")
    return {"beta": _number(config, "beta", 0.05, lambda v: v >= 0, ">= 0")}


_RL_INPUTS = {"target_tokens": FieldSpec("token"), "old_logprobs": FieldSpec("float"),
              "advantages": FieldSpec("float")}
_RL_REQUIRED = frozenset(_RL_INPUTS)


LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy,
                              {"target_tokens": FieldSpec("token", allow_2d=True),
                               "weights": FieldSpec("float", allow_2d=True, default=1.0)},
                              frozenset({"target_tokens"}), _no_config("cross_entropy")),
    "importance_sampling": LossSpec(importance_sampling, _RL_INPUTS, _RL_REQUIRED, _no_config("importance_sampling")),
    "ppo": LossSpec(ppo, _RL_INPUTS, _RL_REQUIRED, _ppo_config),
    "cispo": LossSpec(cispo, _RL_INPUTS, _RL_REQUIRED, _cispo_config),
    "dro": LossSpec(dro, _RL_INPUTS, _RL_REQUIRED, _dro_config),
}


def loss_spec(name: str) -> LossSpec:
    """The spec of a loss by name; an unknown name is an error listing the known ones."""
    if name == "opsd":
        from whitney.engine.opsd import SPEC

        return SPEC
    if name not in LOSSES:
        raise InvalidInput(f"unknown loss function {name!r}; known: {sorted([*LOSSES, 'opsd'])}",
                           field="loss_fn")
    return LOSSES[name]


LOSS_NAMES = (*LOSSES, "opsd")

