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

    Names ending in `.lora_B` get the LoRA+ learning rate. Clears `grads` afterwards.
    """
    with torch.no_grad():
        # 1. gradient_scale_v1: scale the accumulated gradient once.
        g = {name: grads[name] * hp.gradient_scale for name in weights}
        # 2. global norm before clipping.
        norm = math.sqrt(sum(float(t.double().pow(2).sum()) for t in g.values()))
        # 3. clip to gradient_clip_norm (torch.nn.utils.clip_grad_norm_'s rule).
        if hp.gradient_clip_norm > 0 and norm > hp.gradient_clip_norm:
            factor = hp.gradient_clip_norm / (norm + 1e-6)
            for t in g.values():
                t.mul_(factor)
        # 4. AdamW with bias correction and decoupled weight decay.
        state.step += 1
        bc1 = 1 - hp.beta1 ** state.step
        bc2 = 1 - hp.beta2 ** state.step
        lr_b = hp.learning_rate * hp.lora_plus_ratio
        for name, p in weights.items():
            lr = lr_b if name.endswith(".lora_B") else hp.learning_rate
            m = state.exp_avg.setdefault(name, torch.zeros_like(p))
            v = state.exp_avg_sq.setdefault(name, torch.zeros_like(p))
            p.mul_(1 - lr * hp.weight_decay)
            m.lerp_(g[name], 1 - hp.beta1)
            v.mul_(hp.beta2).addcmul_(g[name], g[name], value=1 - hp.beta2)
            denom = (v.sqrt() / math.sqrt(bc2)).add_(hp.eps)
            p.addcdiv_(m, denom, value=-lr / bc1)
        # 5. zero the accumulated gradient.
        for t in grads.values():
            t.zero_()
    return {"grad_norm": norm, "step": float(state.step), "learning_rate": hp.learning_rate,
            "learning_rate_lora_B": lr_b}
