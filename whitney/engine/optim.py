"""AdamW over one run's LoRA weights: scale, norm, clip, update, zero — one function, top to bottom.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), written out so
that LoRA+ (a separate learning rate for B) and gradient_scale_v1 are explicit; a test checks it
against torch.optim.AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields

import torch

from whitney.errors import InvalidInput, check


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


@dataclass
class OptimizerState:
    """AdamW moments per weight name and the number of steps taken."""

    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)


def optim_step(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: OptimizerState,
               hp: AdamParams) -> dict[str, float]:
    """One AdamW step on `weights` (name -> tensor, updated in place) from accumulated `grads`.

    A weight without an accumulated gradient gets a zero one. Names ending in `.lora_B` get the LoRA+
    learning rate. Each stage is one multi-tensor (`torch._foreach_*`) call over all the run's
    tensors, not a Python loop per tensor. Consumes `grads`: it is emptied afterwards (memory freed).
    """
    with torch.no_grad():
        names = list(weights)
        g = [grads[n] if n in grads else torch.zeros_like(weights[n]) for n in names]
        # 1. gradient_scale_v1: scale the accumulated gradient once (in place; grads are consumed).
        if hp.gradient_scale != 1.0:
            torch._foreach_mul_(g, hp.gradient_scale)
        # 2. global norm before clipping, accumulated in float64.
        norm = math.sqrt(float(torch.stack(torch._foreach_norm(g, 2, dtype=torch.float64)).pow(2).sum())) if g else 0.0
        # 3. clip to gradient_clip_norm (torch.nn.utils.clip_grad_norm_'s rule).
        if hp.gradient_clip_norm > 0 and norm > hp.gradient_clip_norm:
            torch._foreach_mul_(g, hp.gradient_clip_norm / (norm + 1e-6))
        # 4. AdamW with bias correction and decoupled weight decay, per learning-rate group (A, B).
        state.step += 1
        bc1 = 1 - hp.beta1 ** state.step
        bc2 = 1 - hp.beta2 ** state.step
        lr_b = hp.learning_rate * hp.lora_plus_ratio
        for n in names:
            if n not in state.exp_avg:
                state.exp_avg[n] = torch.zeros_like(weights[n])
                state.exp_avg_sq[n] = torch.zeros_like(weights[n])
        for is_b, lr in ((False, hp.learning_rate), (True, lr_b)):
            idx = [i for i, n in enumerate(names) if n.endswith(".lora_B") == is_b]
            if not idx:
                continue
            p = [weights[names[i]] for i in idx]
            m = [state.exp_avg[names[i]] for i in idx]
            v = [state.exp_avg_sq[names[i]] for i in idx]
            gi = [g[i] for i in idx]
            if hp.weight_decay:
                torch._foreach_mul_(p, 1 - lr * hp.weight_decay)
            torch._foreach_lerp_(m, gi, 1 - hp.beta1)
            torch._foreach_mul_(v, hp.beta2)
            torch._foreach_addcmul_(v, gi, gi, value=1 - hp.beta2)
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, math.sqrt(bc2))
            torch._foreach_add_(denom, hp.eps)
            torch._foreach_addcdiv_(p, m, denom, value=-lr / bc1)
        # 5. release the accumulated gradient.
        grads.clear()
    return {"grad_norm": norm, "step": float(state.step), "learning_rate": hp.learning_rate,
            "learning_rate_lora_B": lr_b}
