"""opsd: native on-policy self-distillation with a hint-conditioned teacher through the same weights.

A datum carries two streams, each with its own length:
  student: `token_ids` [N], `target_tokens` [N], `loss_mask` [N] (supervised CE), `kl_mask` [N], `kl_ids` [N]
  teacher: `teacher_token_ids` [M], `teacher_target_tokens` [M], `teacher_kl_mask` [M], `teacher_kl_ids` [M]
Targets are next-token ids aligned with prediction positions (target[t] = token_ids[t + 1] wherever a
mask is on); the last position of each stream has no target, so every mask must be zero there.
kl_ids number the active KL positions 0..K-1 in each stream; position k of the student is paired
with position k of the teacher, and both must predict the same target token.

Per row (datum): ce_coef * CE_sum / N_CE + kl_coef * KL_sum / N_KL, where
  CE_sum = -sum over loss_mask positions of l_t,
  KL_sum = sum over the K pairs of KL(teacher || student) over the full vocabulary,
and an empty component contributes zero. The loss is the **sum of the row objectives**, not a mean.
The teacher stream gets no gradient.

Metrics (named `<name>:<reduction>` like every loss's, loss_table.metric_reduction): `opsd_objective_sum:sum`
the loss; `opsd_kl:mean` the mean KL over the request's KL pairs; `ce_loss:mean` the mean CE over its
loss_mask tokens (each merged over micro-batches by its own count).
"""

from __future__ import annotations

import torch

from whitney.engine.losses.datum import FieldSpec, PreparedDatum
from whitney.engine.losses.table import LossOutput, LossSpec, Param
from whitney.errors import InvalidInput, check

TEACHER = "teacher_token_ids"
INPUTS = {
    "target_tokens": FieldSpec("token"),
    "loss_mask": FieldSpec("mask", default=0.0),
    "kl_mask": FieldSpec("mask"),
    "kl_ids": FieldSpec("int"),
    TEACHER: FieldSpec("token", rows=TEACHER),
    "teacher_target_tokens": FieldSpec("token", rows=TEACHER),
    "teacher_kl_mask": FieldSpec("mask", rows=TEACHER),
    "teacher_kl_ids": FieldSpec("int", rows=TEACHER),
}
REQUIRED = frozenset(INPUTS) - {"loss_mask"}


def _at_least_one(values: dict[str, float], given: set[str]) -> dict:
    """ce_coef and kl_coef (each finite, >= 0, default 1.0): at least one must be positive."""
    check(values["ce_coef"] > 0 or values["kl_coef"] > 0, "opsd needs ce_coef or kl_coef to be positive",
          field="loss_config.kl_coef")
    return values


def _kl_positions(ids: torch.Tensor, mask: torch.Tensor, index: int, field: str) -> torch.Tensor:
    """Positions [K] of the active KL tokens, ordered by kl_id; the ids must be exactly 0..K-1."""
    active = mask.bool()
    ids_on = ids[active]
    k = int(ids_on.numel())
    if k and not torch.equal(torch.sort(ids_on).values, torch.arange(k, device=ids.device)):
        raise InvalidInput(f"datum {index}: active {field} must be exactly 0..{k - 1} once each, got "
                           f"{sorted(ids_on.tolist())[:8]}", field=field, datum_index=index)
    positions = active.nonzero()[:, 0]  # [K] in stream order
    return positions[torch.argsort(ids_on)]


def _aligned(tokens: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor, index: int, field: str) -> None:
    on = mask[:-1].bool()
    bad = on & (targets[:-1] != tokens[1:])
    if bool(bad.any()):
        t = int(bad.nonzero()[0][0])
        raise InvalidInput(f"datum {index}: {field}[{t}] is {int(targets[t])} but the next input token is "
                           f"{int(tokens[t + 1])}; targets must be next-token ids", field=field, datum_index=index)


def validate_row(d: PreparedDatum, index: int, config: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply every opsd rule to one datum; return the paired KL positions (student [K], teacher [K])."""
    x = d.inputs
    loss_mask = x["loss_mask"]
    for name, mask in (("loss_mask", loss_mask), ("kl_mask", x["kl_mask"]), ("teacher_kl_mask", x["teacher_kl_mask"])):
        if mask[-1] != 0:
            raise InvalidInput(f"datum {index}: {name} must be 0 at the trailing position, which has no target",
                               field=name, datum_index=index)
    if bool((loss_mask.bool() & x["kl_mask"].bool()).any()):
        raise InvalidInput(f"datum {index}: loss_mask and kl_mask overlap; they must be disjoint",
                           field="loss_mask", datum_index=index)
    _aligned(d.tokens, x["target_tokens"], loss_mask + x["kl_mask"], index, "target_tokens")
    _aligned(x[TEACHER], x["teacher_target_tokens"], x["teacher_kl_mask"], index, "teacher_target_tokens")
    student = _kl_positions(x["kl_ids"], x["kl_mask"], index, "kl_ids")
    teacher = _kl_positions(x["teacher_kl_ids"], x["teacher_kl_mask"], index, "teacher_kl_ids")
    if student.numel() != teacher.numel():
        raise InvalidInput(f"datum {index}: the student has {student.numel()} KL positions and the teacher "
                           f"{teacher.numel()}; they must pair one to one", field="teacher_kl_mask", datum_index=index)
    s_tgt, t_tgt = x["target_tokens"][student], x["teacher_target_tokens"][teacher]
    if not torch.equal(s_tgt, t_tgt):
        k = int((s_tgt != t_tgt).nonzero()[0][0])
        raise InvalidInput(f"datum {index}: KL pair {k} has student target {int(s_tgt[k])} but teacher target "
                           f"{int(t_tgt[k])}; paired targets must be identical", field="teacher_target_tokens",
                           datum_index=index)
    if config["ce_coef"] > 0 and not bool(loss_mask.any()):
        raise InvalidInput(f"datum {index}: ce_coef > 0 needs supervised tokens (loss_mask) in every row; "
                           "set ce_coef=0.0 for KL-only training", field="loss_mask", datum_index=index)
    if config["ce_coef"] == 0 and student.numel() == 0:
        raise InvalidInput(f"datum {index}: with ce_coef=0 every row needs KL tokens (kl_mask)",
                           field="kl_mask", datum_index=index)
    return student, teacher


def objective(lp: list[torch.Tensor], student_kl: list[torch.Tensor], teacher_kl: list[torch.Tensor],
              loss_masks: list[torch.Tensor], kl_positions: list[torch.Tensor], config: dict) -> LossOutput:
    """Sum over rows of ce_coef * CE_sum / N_CE + kl_coef * KL_sum / N_KL.

    Per row i: lp[i] [N] learner log-probs of target_tokens; student_kl[i], teacher_kl[i] [K, V]
    full-vocabulary log-probs at the paired positions (teacher detached); loss_masks[i] [N];
    kl_positions[i] [K] student positions of the pairs. Returns the concatenated per-token loss [sum N].
    """
    ce_coef, kl_coef = config["ce_coef"], config["kl_coef"]
    total = lp[0].new_zeros(())
    per_token, ce_sum, ce_n, kl_sum, kl_n = [], 0.0, 0, 0.0, 0
    for l, s, t, m, pos in zip(lp, student_kl, teacher_kl, loss_masks, kl_positions):
        contrib = torch.zeros_like(l)
        n_ce, n_kl = int(m.sum()), int(pos.numel())
        if n_ce:
            ce_tok = -(l * m)  # [N]
            total = total + ce_coef * ce_tok.sum() / n_ce
            contrib = contrib + ce_coef * ce_tok / n_ce
            ce_sum, ce_n = ce_sum + float(ce_tok.detach().sum()), ce_n + n_ce
        if n_kl:
            t = t.detach()  # the teacher stream never gets a gradient
            kl_tok = (t.exp() * (t - s)).sum(-1)  # [K] KL(teacher || student) per pair
            total = total + kl_coef * kl_tok.sum() / n_kl
            contrib = contrib.index_add(0, pos, kl_coef * kl_tok / n_kl)
            kl_sum, kl_n = kl_sum + float(kl_tok.detach().sum()), kl_n + n_kl
        per_token.append(contrib.detach())
    metrics = {
        "loss:sum": float(total.detach()),
        "opsd_objective_sum:sum": float(total.detach()),
        "opsd_kl:mean": kl_sum / kl_n if kl_n else 0.0,
        "ce_loss:mean": ce_sum / ce_n if ce_n else 0.0,
        "tokens:sum": float(sum(x.numel() for x in lp)),
    }
    return LossOutput(total, torch.cat(per_token), torch.cat([x.detach() for x in lp]), metrics,
                      {"opsd_kl:mean": float(kl_n), "ce_loss:mean": float(ce_n)})


def loss(lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict) -> LossOutput:
    """The table's entry point (loss_table.py's contract): the request's concatenation split back into
    rows, then `objective`. lp [N]; datum_index [N]; loss_mask [N]; kl_index [P] positions in [0, N) of
    the KL pairs, row by row in kl_id order; student_kl, teacher_kl [P, V]."""
    rows = inputs["datum_index"]  # [N]
    B = int(rows[-1]) + 1
    lengths = torch.bincount(rows, minlength=B)  # [B]
    starts = torch.cumsum(lengths, 0) - lengths  # [B] first position of each row
    pair_rows = rows[inputs["kl_index"]]  # [P]
    pairs = torch.bincount(pair_rows, minlength=B).tolist()
    local = (inputs["kl_index"] - starts[pair_rows]).split(pairs)  # [K_i] student positions per row
    n = lengths.tolist()
    return objective(list(lp.split(n)), list(inputs["student_kl"].split(pairs)),
                     list(inputs["teacher_kl"].split(pairs)), list(inputs["loss_mask"].split(n)), list(local), config)


_COEF = Param(1.0, lambda v: v >= 0, "finite and non-negative")
SPEC = LossSpec("opsd", loss, INPUTS, REQUIRED, {"ce_coef": _COEF, "kl_coef": _COEF}, _at_least_one,
                check_row=validate_row, teacher=TEACHER)

