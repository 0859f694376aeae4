"""AdamW over runs' LoRA weights: scale, norm, refuse a non-finite gradient, clip, update, zero — one function,
top to bottom, for one run or for many at once (`optim_steps`, the scheduler's batch of ready optim_steps).

A run whose accumulated gradient (after gradient_scale) holds a NaN or an infinity takes no step: its weights and
AdamW state stay bitwise as they were, its gradient is dropped (so its next forward_backward starts a new one and
the run can go on), and its result is a `NonFiniteGradient` naming the modules; the other runs of the same call
step as if it were not there.

The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments), written out so
that LoRA+ (a separate learning rate for B) and gradient_scale_v1 are explicit; a test checks it
against torch.optim.AdamW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from whitney.errors import InvalidInput
from whitney.protocol.training import AdamParams


@dataclass
class OptimizerState:
    """AdamW moments per weight name and the number of steps taken."""

    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)


class NonFiniteGradient(InvalidInput):
    """A run's accumulated gradient holds NaN or infinity: its step was refused (weights and AdamW state
    unchanged) and the gradient dropped. `weights`: the names of the weights whose gradient is not finite."""

    def __init__(self, weights: list[str], run_id: str | None = None):
        self.weights = weights
        modules = list(dict.fromkeys(w.rsplit(".lora_", 1)[0] for w in weights))  # the adapted modules, in order
        shown = ", ".join(modules[:3]) + (f" and {len(modules) - 3} more" if len(modules) > 3 else "")
        whose = f"of run {run_id!r} " if run_id is not None else ""
        plural = "s" if len(modules) != 1 else ""
        super().__init__(f"the accumulated gradient {whose}is not finite (NaN or infinity, after gradient_scale) in "
                         f"{len(modules)} module{plural}: {shown}; the optim_step is refused: the weights and "
                         "optimizer state are unchanged and the gradient was dropped, so the next forward_backward "
                         "starts a new one (a loss or inputs giving NaN or infinity, or a gradient_scale too large, "
                         "are the usual causes)")

    def of_run(self, run_id: str) -> "NonFiniteGradient":
        return NonFiniteGradient(self.weights, run_id)


# Runs of at most this many weight elements in all are updated in one pass of `optim_steps` (bounds the
# temporary denominators to 4 MB of float32). The steps are memory-bound: on the CPU one pass over many runs
# takes about the time of their per-run steps, so what batching saves is the scheduler's per-operation work
# (one backend call, one store transaction), not arithmetic.
STEP_CHUNK_ELEMENTS = 1 << 20


def optim_step(weights: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], state: OptimizerState,
               hp: AdamParams) -> dict[str, float]:
    """One AdamW step on `weights` (name -> tensor, updated in place) from accumulated `grads`.

    A weight without an accumulated gradient gets a zero one. Names ending in `.lora_B` get the LoRA+
    learning rate. Consumes `grads`: it is emptied afterwards (memory freed). `optim_steps` of one run; a
    gradient that is not finite raises NonFiniteGradient (no step taken, `grads` emptied).
    """
    (metrics,) = optim_steps([(weights, grads, state, hp)])
    if isinstance(metrics, NonFiniteGradient):
        raise metrics
    return metrics


def optim_steps(steps: list[tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], OptimizerState, AdamParams]]
                ) -> list[dict[str, float] | NonFiniteGradient]:
    """One AdamW step for each of several runs, `(weights, grads, state, hp)` each, with their own
    hyperparameters: each run's result is bitwise its own `optim_step`. A run whose gradient is not finite
    gets a NonFiniteGradient instead of metrics, and no step (its gradient dropped).

    Each stage is one multi-tensor (`torch._foreach_*`) call over every tensor of a chunk of runs, with
    each tensor's own scalar (its run's learning rate, betas, clip coefficient...), not a Python loop per
    run or per tensor: on the CPU a foreach call loops over the tensors in C++, per tensor the same kernel
    as a scalar call, so the numbers are the per-run ones. Runs are taken in chunks of at most
    STEP_CHUNK_ELEMENTS weight elements (the temporary denominators).
    """
    metrics: list[dict[str, float] | NonFiniteGradient] = []
    chunk: list = []
    size = 0
    for step in steps:
        n = sum(w.numel() for w in step[0].values())
        if chunk and size + n > STEP_CHUNK_ELEMENTS:
            metrics += _steps(chunk)
            chunk, size = [], 0
        chunk.append(step)
        size += n
    return metrics + (_steps(chunk) if chunk else [])


def _steps(steps: list) -> list[dict[str, float] | NonFiniteGradient]:
    """`optim_steps` of one chunk: scale, norm, refuse a non-finite gradient, clip, AdamW, zero, metrics."""
    with torch.no_grad():
        # The chunk's gradients in one list; run i owns [bounds[i], bounds[i + 1]).
        g, names, owner, bounds = [], [], [], [0]
        for i, (weights, grads, _, _) in enumerate(steps):
            for n, w in weights.items():
                g.append(grads[n] if n in grads else torch.zeros_like(w))
                names.append(n)
                owner.append(i)
            bounds.append(len(g))
        hps = [hp for *_, hp in steps]
        # 1. gradient_scale_v1: scale the accumulated gradient once (in place; grads are consumed).
        if any(hp.gradient_scale != 1.0 for hp in hps):
            torch._foreach_mul_(g, [hps[i].gradient_scale for i in owner])  # x * 1.0 is x: others unchanged
        # 2. each run's global norm before clipping, accumulated in float64.
        norms = torch._foreach_norm(g, 2, dtype=torch.float64) if g else []
        run_norms = [math.sqrt(float(torch.stack(norms[a:b]).pow(2).sum())) if b > a else 0.0
                     for a, b in zip(bounds, bounds[1:])]
        # 3. a run whose norm is not finite (a NaN or an infinity in its gradient: float64 sums of float32
        # squares do not overflow) takes no step; the others' tensors alone go on, in the same order.
        refused: dict[int, NonFiniteGradient] = {}
        for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
            if not math.isfinite(run_norms[i]):
                finite = torch.isfinite(torch.stack(norms[a:b])).tolist()
                refused[i] = NonFiniteGradient([names[j] for j, ok in zip(range(a, b), finite) if not ok])
        kept = [j for j in range(len(g)) if owner[j] not in refused]
        p, m, v, is_b = [], [], [], []
        for j in kept:
            weights, _, state, _ = steps[owner[j]]
            n = names[j]
            if n not in state.exp_avg:  # a run's first step: zero moments
                state.exp_avg[n] = torch.zeros_like(weights[n])
                state.exp_avg_sq[n] = torch.zeros_like(weights[n])
            p.append(weights[n])
            m.append(state.exp_avg[n])
            v.append(state.exp_avg_sq[n])
            is_b.append(n.endswith(".lora_B"))
        g, owner = [g[j] for j in kept], [owner[j] for j in kept]
        # 4. clip to gradient_clip_norm (torch.nn.utils.clip_grad_norm_'s rule), per run.
        clip = [hp.gradient_clip_norm / (norm + 1e-6) if 0 < hp.gradient_clip_norm < norm else 1.0
                for hp, norm in zip(hps, run_norms)]
        if any(c != 1.0 for c in clip):
            torch._foreach_mul_(g, [clip[i] for i in owner])
        # 5. AdamW with bias correction and decoupled weight decay; each tensor's learning rate is its
        # run's, times lora_plus_ratio for B.
        for i, (_, _, state, _) in enumerate(steps):
            if i not in refused:
                state.step += 1
        lr = [hps[i].learning_rate * (hps[i].lora_plus_ratio if b else 1.0) for i, b in zip(owner, is_b)]
        bc1 = [1 - hps[i].beta1 ** steps[i][2].step for i in owner]
        bc2 = [1 - hps[i].beta2 ** steps[i][2].step for i in owner]
        if p:
            if any(hp.weight_decay for hp in hps):
                torch._foreach_mul_(p, [1 - r * hps[i].weight_decay for r, i in zip(lr, owner)])
            torch._foreach_lerp_(m, g, [1 - hps[i].beta1 for i in owner])
            torch._foreach_mul_(v, [hps[i].beta2 for i in owner])
            torch._foreach_addcmul_(v, g, g, [1 - hps[i].beta2 for i in owner])
            denom = torch._foreach_sqrt(v)
            torch._foreach_div_(denom, [math.sqrt(b2) for b2 in bc2])
            torch._foreach_add_(denom, [hps[i].eps for i in owner])
            torch._foreach_addcdiv_(p, m, denom, [-r / b1 for r, b1 in zip(lr, bc1)])
        # 6. release the accumulated gradients (a refused run's too: dropped).
        for _, grads, _, _ in steps:
            grads.clear()
    return [refused[i] if i in refused else
            {"grad_norm": norm, "step": float(state.step), "learning_rate": hp.learning_rate,
             "learning_rate_lora_B": hp.learning_rate * hp.lora_plus_ratio}
            for i, (norm, (_, _, state, hp)) in enumerate(zip(run_norms, steps))]
