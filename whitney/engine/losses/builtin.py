"""The loss table `LOSSES`: every loss one `LossSpec` (loss_table.py), opsd (opsd.py) and custom graphs
(custom_loss.py, one `custom` entry specialised per graph) included.

The losses written here are token-summed: each takes the learner's log-probs of the targets and the
datum's tensors, concatenated over the datums of one request (the sums make that equivalent to
per-datum calls; gspo's per-datum ratio reads `datum_index`), and returns the loss **summed over
tokens, never averaged**, the per-token loss and detached metrics.

Notation: l_t learner log-prob of the target, q_t sampler log-prob (`old_logprobs`), r_t = exp(l_t - q_t),
A_t advantage, w_t weight, sg = stop-gradient. Shapes: N tokens, K soft-target candidates.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

import torch

from whitney.engine.losses import custom as custom_loss
from whitney.engine.losses import custom_run
from whitney.engine.losses import opsd
from whitney.engine.losses.datum import FieldSpec, PreparedDatum
from whitney.engine.losses.table import SCALAR, LossOutput, LossSpec, Param, lookup
from whitney.errors import InvalidInput, check
from whitney.protocol.training import metric_reduction


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
    return _clipped_surrogate(lp, torch.exp(lp - inputs["old_logprobs"]), inputs["advantages"], config)


def _clipped_surrogate(lp: torch.Tensor, ratio: torch.Tensor, adv: torch.Tensor, config: dict) -> LossOutput:
    """L = -sum_t min(r_t A_t, clip(r_t, low, high) A_t) for ratios r [N] (ppo's per token, gspo's per
    datum), summed over tokens; `clipped_fraction:mean` is the share of tokens the clip bound."""
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


def gspo(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """GSPO-token: L = -sum_t min(s_t A_t, clip(s_t, low, high) A_t), with one ratio per datum.

    Datum b's sequence ratio is s_b = exp(mean over its marked positions M_b (sequence_ratio_mask != 0)
    of l_t - q_t); every position t of b carries s_t = sg(s_b) * exp(l_t - sg(l_t)): s_b's value, the
    gradient of its own l_t. Summed over tokens like ppo, whose clipping it shares.
    """
    rows = inputs["datum_index"]  # [N] datum of each position
    B = int(rows.max()) + 1 if rows.numel() else 0
    marked = (inputs["sequence_ratio_mask"] != 0).to(lp.dtype)  # [N]
    sums = lp.new_zeros(B).index_add(0, rows, (lp.detach() - inputs["old_logprobs"]) * marked)  # [B]
    counts = lp.new_zeros(B).index_add(0, rows, marked)  # [B], >= 1 each (check_row)
    ratio = torch.exp((sums / counts)[rows] + lp - lp.detach())  # [N]: value s_b, d/dl_t = s_b
    return _clipped_surrogate(lp, ratio, inputs["advantages"], config)


def _gspo_row(d: PreparedDatum, index: int, config: dict) -> None:
    check(bool((d.inputs["sequence_ratio_mask"] != 0).any()),
          f"datum {index}: sequence_ratio_mask marks no position; gspo's sequence ratio is a mean over the "
          "positions it marks (the sampled tokens)", field="sequence_ratio_mask", datum_index=index)


def custom(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """A client's graph (custom_loss.py) per datum b: L = sum_b L_b(l_b, inputs_b), summed over datums.

    Each L_b runs on a detached copy x_b of the datum's log-probs, and reaches the learner as
    sum_t g_t l_t with g_t = dL_b/dx_t (value L_b): the exact gradient, without the graph ever holding
    the model's tensors. elementwise_loss is g_t l_t (the first-order share the SDK's client-side
    custom path reports; it need not sum to L_b); the per-position log-prob shown for [N, K] targets is the
    mean over K. Metrics: custom/<name>:sum added over datums, custom/<name>:mean averaged over them.
    """
    program = config["program"]
    counts = torch.bincount(inputs["datum_index"]).tolist()  # tokens per datum (each has >= 1)
    starts = [sum(counts[:b]) for b in range(len(counts))]
    grads, total, sums = [], lp.new_zeros((), dtype=torch.float64), {}
    for b, (start, n) in enumerate(zip(starts, counts)):
        with torch.enable_grad():
            x = lp[start:start + n].detach().requires_grad_(True)  # [N] or [N, K]
            values = [x] + [inputs[name][b] if rank == 0 else inputs[name][start:start + n]
                            for name, rank in program.inputs[1:]]
            try:
                loss_b, metrics_b = custom_run.run_program(program, values)
            except InvalidInput as e:  # the batch step fails this request alone (Engine._compute)
                raise InvalidInput(f"datum {b}: {e.message}", field=e.field, datum_index=b) from None
            g = torch.autograd.grad(loss_b, x, allow_unused=True)[0] if loss_b.requires_grad else None
        grads.append(torch.zeros_like(x) if g is None else g)
        total = total + loss_b.detach().double()
        for key, value in metrics_b.items():
            sums[key] = sums.get(key, 0.0) + float(value)
    g = torch.cat(grads)  # [N] or [N, K]
    surrogate = (g * lp).sum()
    loss = total.to(lp.dtype) + (surrogate - surrogate.detach())  # value sum_b L_b, gradient sum_t g_t dl_t
    share = (g * lp.detach())
    shown = lp.detach()
    if lp.dim() == 2:
        share, shown = share.sum(-1), shown.mean(-1)
    B = len(counts)
    means = {key for key in sums if metric_reduction(key) == "mean"}
    metrics = {key: v / B if key in means else v for key, v in sums.items()}
    return LossOutput(loss, share.detach(), shown, {**_metrics(loss, lp.shape[0]), **metrics},
                      {key: float(B) for key in means})


def _custom_bind(raw: dict) -> tuple[LossSpec, dict]:
    """The custom entry for one graph: target_tokens and the inputs the graph declares."""
    program = custom_loss.compile_loss(raw)
    inputs = {"target_tokens": FieldSpec("token", allow_2d=True)}
    for name, rank in program.inputs[1:]:
        inputs[name] = (FieldSpec("token", allow_2d=True) if name == "target_tokens"
                        else FieldSpec("float", rows=SCALAR if rank == 0 else "N", allow_2d=rank == 2))
    return replace(LOSSES["custom"], inputs=inputs, required=frozenset(inputs)), {"program": program}


def _custom_check(datums: list[PreparedDatum], config: dict) -> list[int]:
    """Ranks as declared, then the graph planned on each datum's shapes (custom_run.check_budget): a node over
    a size bound or failing on those shapes, or a request over its work budget, is refused before anything
    runs, and before the request joins a batch with other runs. Returns each datum's graph work."""
    program = config["program"]
    for index, d in enumerate(datums):
        for name, rank in ((n, r) for n, r in program.inputs if r > 0):
            t = d.inputs["target_tokens" if name == "logprobs" else name]
            check(t.dim() == rank, f"datum {index}: {'target_tokens' if name == 'logprobs' else name} has rank "
                  f"{t.dim()}, but custom loss {program.name!r} declares {name} with rank {rank}",
                  field="target_tokens" if name == "logprobs" else name, datum_index=index)
    shapes = [((tuple(d.inputs["target_tokens"].shape), torch.float32),  # the learner's log-probs
               *((tuple(d.inputs[n].shape), d.inputs[n].dtype) for n, _ in program.inputs[1:])) for d in datums]
    return custom_run.check_budget(program, shapes, sum(int(d.inputs["target_tokens"].numel()) for d in datums))


# ---- loss_config: each key once, with its default and rule; the cross-key rules --------------------

def _in_unit(v: float) -> bool:
    return 0 <= v <= 1


# Tinker's absolute bounds on the ratio, the other form of ppo's, cispo's and gspo's clipping.
_THRESHOLDS = {"clip_low_threshold": Param(0.8, _in_unit, "in [0, 1]"),
               "clip_high_threshold": Param(1.2, lambda v: v >= 1, ">= 1")}
_PPO_PARAMS = {"clip_low": Param(0.2, _in_unit, "in [0, 1]"), "clip_high": Param(0.2, lambda v: v >= 0, ">= 0"),
               **_THRESHOLDS}
CISPO_DEFAULT_EPS_MAX = 5.0
_CISPO_PARAMS = {"eps_max": Param(CISPO_DEFAULT_EPS_MAX, lambda v: v > 0, "> 0"), **_THRESHOLDS}


def _one_form(loss: str, given: set[str], other_form: tuple[str, ...]) -> bool:
    """True when the absolute *_threshold bounds are given; giving both forms is InvalidInput."""
    absolute = {"clip_low_threshold", "clip_high_threshold"} & given
    check(not (absolute and set(other_form) & given), f"{loss}: give either {sorted(other_form)} or "
          "clip_low_threshold/clip_high_threshold, not both", field=f"loss_config.{min(absolute or {''})}")
    return bool(absolute)


def _epsilon_bounds(loss: str) -> Callable[[dict, set[str]], dict]:
    """{low, high} absolute bounds: [1 - clip_low, 1 + clip_high], or Tinker's thresholds as given."""
    def resolve(v: dict, given: set[str]) -> dict:
        if _one_form(loss, given, ("clip_low", "clip_high")):
            return {"low": v["clip_low_threshold"], "high": v["clip_high_threshold"]}
        return {"low": 1.0 - v["clip_low"], "high": 1.0 + v["clip_high"]}
    return resolve


def _cispo_bounds(v: dict, given: set[str]) -> dict:
    """{low, high}: (0, eps_max], or Tinker's thresholds as given."""
    if _one_form("cispo", given, ("eps_max",)):
        return {"low": v["clip_low_threshold"], "high": v["clip_high_threshold"]}
    return {"low": 0.0, "high": v["eps_max"]}


# ---- the table ------------------------------------------------------------------------------------

_RL_INPUTS = {"target_tokens": FieldSpec("token"), "old_logprobs": FieldSpec("float"),
              "advantages": FieldSpec("float")}
_RL_REQUIRED = frozenset(_RL_INPUTS)
_GSPO_INPUTS = {**_RL_INPUTS, "sequence_ratio_mask": FieldSpec("float")}

LOSSES: dict[str, LossSpec] = {spec.name: spec for spec in (
    LossSpec("cross_entropy", cross_entropy,
             {"target_tokens": FieldSpec("token", allow_2d=True),
              "weights": FieldSpec("float", allow_2d=True, default=1.0)}, frozenset({"target_tokens"}),
             gradient=lambda inputs, config: -inputs["weights"]),
    LossSpec("importance_sampling", importance_sampling, _RL_INPUTS, _RL_REQUIRED),
    LossSpec("ppo", ppo, _RL_INPUTS, _RL_REQUIRED, _PPO_PARAMS, _epsilon_bounds("ppo")),
    # Tinker's cispo clips to its absolute 0.8 / 1.2 unless told otherwise; the native default is eps_max.
    LossSpec("cispo", cispo, _RL_INPUTS, _RL_REQUIRED, _CISPO_PARAMS, _cispo_bounds,
             tinker_defaults={"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    LossSpec("dro", dro, _RL_INPUTS, _RL_REQUIRED, {"beta": Param(0.05, lambda v: v >= 0, ">= 0")}),
    LossSpec("gspo", gspo, _GSPO_INPUTS, frozenset(_GSPO_INPUTS), _PPO_PARAMS, _epsilon_bounds("gspo"),
             check_row=_gspo_row),
    opsd.SPEC,
    # One entry for every custom graph: `bind` specialises it to the graph in loss_config.
    LossSpec("custom", custom, {}, frozenset(), check_datums=_custom_check, bind=_custom_bind),
)}
LOSS_NAMES = tuple(LOSSES)
# Names the Tinker SDK knows that this table does not serve, and why (a clearer 400 than "unknown").
UNSERVED = {
    "stable_reinforce": "its objective and the stability information its sampler records are not published",
}


def loss_spec(name: str) -> LossSpec:
    """The table's entry for a loss; an unknown name is InvalidInput listing the known ones."""
    return lookup(LOSSES, name, UNSERVED)


def describe() -> dict[str, dict]:
    """Every loss's public description as plain data (see LossSpec.describe)."""
    return {name: spec.describe() for name, spec in LOSSES.items()}


class LossMethods:
    """The Backend's loss calls, the same for every backend: the loss table as plain data, and a custom loss
    graph checked against the allow-lists (custom_loss.compile_loss; InvalidInput naming the node)."""

    def losses(self) -> dict[str, dict]:
        return describe()

    def check_custom_loss(self, definition: dict) -> None:
        custom_loss.compile_loss(definition)
