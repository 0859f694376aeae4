"""One training or scoring pass over requests of several runs on one base model: their datums padded into one
[B, T] batch with rows grouped per adapter, the shared forward once, each request's target log-probs and loss,
and (for forward_backward) the gradients of the sum of the requests' losses, each run's share added to its own
accumulator. The Engine (runs.py) validates the requests and cuts them into passes; every request here is valid.

Shape legend: B rows (datums), T padded length, D hidden, V vocab, N tokens of one request, K soft targets,
P KL pairs (opsd).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from whitney.engine.families.decoder import BaseModel, full_logprobs
from whitney.engine.families.lora import Adapter, RowGroups
from whitney.engine.losses.datum import PreparedDatum
from whitney.engine.losses.table import SCALAR, LossOutput, LossSpec
from whitney.engine.losses.unembedding import target_logprobs
from whitney.engine.training.run import Run
from whitney.errors import WhitneyError
from whitney.protocol.training import DatumOutput, ForwardRequest, ForwardResult


@dataclass
class Prepared:
    """A request checked and ready for a pass: its run and adapter (None: the base model), its datums as tensors,
    its loss's table entry and config."""

    request: ForwardRequest
    adapter: Adapter | None
    run: Run | None
    datums: list[PreparedDatum]
    spec: LossSpec  # the loss's table entry
    config: dict
    rows: list | None = None  # per datum, what spec.check_row returned (a teacher pass: KL positions)


def compute_pass(base: BaseModel, items: list[Prepared], backward: bool) -> list[ForwardResult | WhitneyError]:
    """Run the requests `items` (rows of one adapter contiguous) as one pass: each request's result, or the error
    of a loss that refused its values only now (that request alone; the others' gradients are still added)."""
    teacher_kl = teacher_logprobs(base, items)
    with torch.set_grad_enabled(backward):
        _, flat = forward_rows(base, items)  # [sum N, D]
        outputs, start = [], 0
        for it, tk in zip(items, teacher_kl):
            n = sum(d.length for d in it.datums)
            try:
                outputs.append(_loss(base, it, flat[start:start + n], tk))
            except WhitneyError as e:  # a loss refusing its values only now (a custom graph): it alone fails
                outputs.append(e)
            start += n
        ran = [(it, o) for it, o in zip(items, outputs) if isinstance(o, LossOutput)]
        if backward and ran:
            _accumulate([it for it, _ in ran], [o for _, o in ran])
    return [o if isinstance(o, WhitneyError) else forward_result(it, o) for it, o in zip(items, outputs)]


def _loss(base: BaseModel, it: Prepared, h: torch.Tensor, teacher_kl) -> LossOutput:
    """Apply the request's loss to its hidden rows h [N, D] (all its datums, concatenated), with the inputs
    loss_table.py's contract names."""
    targets, inputs = loss_inputs(it, base.device)
    if it.spec.teacher:  # the KL pairs: learner full-vocabulary log-probs here, the teacher's from its pass
        inputs["student_kl"] = student_logprobs(base, it, h, inputs["kl_index"])
        inputs["teacher_kl"] = torch.cat(teacher_kl)  # [P, V]
    # A loss linear in the log-probs knows its gradient now: the unembedding takes it in the same pass.
    known = it.spec.gradient(inputs, it.config) if it.spec.gradient and torch.is_grad_enabled() else None
    lp = target_logprobs(base, h, targets, it.adapter, known)  # [N] or [N, K], logits never all at once
    return it.spec.fn(lp, inputs, it.config)


def loss_inputs(it: Prepared, device: torch.device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The request's target tokens [N] or [N, K] and its loss inputs as the loss contract names them (its datums
    concatenated, moved here from the CPU, where they were validated, to `device`): without the values of the
    model (the log-probs; with a teacher, student_kl and teacher_kl)."""
    targets = torch.cat([d.inputs["target_tokens"] for d in it.datums]).to(device)  # [N] or [N, K]
    per_position = [k for k in it.datums[0].inputs if it.spec.inputs[k].rows == "N"]
    inputs = {k: torch.cat([d.inputs[k] for d in it.datums]).to(device) for k in per_position}
    inputs.update({k: torch.stack([d.inputs[k] for d in it.datums]).to(device)  # [B]: one value per datum
                   for k in it.datums[0].inputs if it.spec.inputs[k].rows == SCALAR})
    lengths = torch.tensor([d.length for d in it.datums], device="cpu")
    inputs["datum_index"] = torch.repeat_interleave(torch.arange(len(it.datums), device="cpu"),
                                                    lengths).to(device)  # [N]
    if it.spec.teacher:
        starts = (torch.cumsum(lengths, 0) - lengths).tolist()
        inputs["kl_index"] = torch.cat([s_pos + start for (s_pos, _), start in zip(it.rows, starts)]
                                       ).to(device)  # [P]
    return targets, inputs


def student_logprobs(base: BaseModel, it: Prepared, h: torch.Tensor, kl_index: torch.Tensor) -> torch.Tensor:
    """The learner's full-vocabulary log-probs [P, V] at the KL pairs' positions kl_index [P] of h [N, D]."""
    return full_logprobs(base.unembed(h[kl_index], RowGroups([(0, len(kl_index), it.adapter)])))


def forward_rows(base: BaseModel, items: list[Prepared], pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The requests' datums padded into one [B, T] batch (rows of one adapter contiguous, each with its images)
    through the model: (hidden [B, T, D], flat [sum N, D] the rows' real positions, row-major, so each
    request's tokens are contiguous). pad: a batch with no datum still runs, as one row of one padding token in
    the first request's group (every adapter's group present, empty), so that a rank of a sharded model makes
    the same collectives as the others (data_parallel.py)."""
    lengths = [d.length for it in items for d in it.datums]
    padding = pad and not lengths
    tokens = torch.zeros(len(lengths) + padding, max(lengths, default=1), dtype=torch.int64, device="cpu")
    for row, d in enumerate(d for it in items for d in it.datums):  # [B, T], right-padded
        tokens[row, : d.length] = d.tokens
    bounds, row = [], 0
    for it in items:
        end = row + len(it.datums) + int(padding and not bounds)  # the padding row: the first group's
        bounds.append((row, end, it.adapter))
        row = end
    images = [d.images for it in items for d in it.datums] + [[]] * padding  # per row, its processed images
    hidden = base.forward_hidden(tokens.to(base.device), RowGroups(bounds), images)  # [B, T, D]
    valid = (torch.arange(tokens.shape[1], device=base.device)[None, :]
             < torch.tensor(lengths + [0] * padding, device=base.device)[:, None])  # [B, T]
    return hidden, hidden[valid]


def teacher_logprobs(base: BaseModel, items: list[Prepared], pad: bool = False) -> list[list[torch.Tensor] | None]:
    """Teacher streams (a loss whose entry names one) through the same weights, no gradient: [K, V]
    log-probs at each datum's paired teacher positions. pad: the pass runs (one padding row) where some
    request has a teacher but none of its datums are here (forward_rows)."""
    out: list[list[torch.Tensor] | None] = [None] * len(items)
    rows = [(i, d.inputs[it.spec.teacher], pair[1]) for i, it in enumerate(items) if it.spec.teacher
            for d, pair in zip(it.datums, it.rows)]
    teachers = [it for it in items if it.spec.teacher]
    if not rows:
        if pad and teachers:
            with torch.no_grad():
                base.forward_hidden(torch.zeros(1, 1, dtype=torch.int64, device=base.device),
                                    RowGroups([(0, 1, teachers[0].adapter)]))
        return out
    T = max(int(stream.shape[0]) for _, stream, _ in rows)
    tokens = torch.zeros(len(rows), T, dtype=torch.int64, device="cpu")  # [R, T] right-padded
    bounds = []
    for r, (i, stream, _) in enumerate(rows):
        tokens[r, : stream.shape[0]] = stream
        bounds.append((r, r + 1, items[i].adapter))
    with torch.no_grad():
        hidden = base.forward_hidden(tokens.to(base.device), RowGroups(bounds))
        for r, (i, _, pos) in enumerate(rows):
            h = hidden[r, pos.to(base.device)]  # [K, D]
            lp = full_logprobs(base.unembed(h, RowGroups([(0, len(pos), items[i].adapter)])))
            out[i] = (out[i] or []) + [lp]
    return out


def _accumulate(items: list[Prepared], outputs: list[LossOutput]) -> None:
    """Gradients of the summed losses; each run's share is added to its own accumulator (or to the
    staging area its request names)."""
    params = adapter_parameters(items)
    grads = torch.autograd.grad(sum(o.loss for o in outputs), [p for _, _, p in params], allow_unused=True)
    add_gradients(params, grads)


def adapter_parameters(items: list[Prepared]) -> list[tuple[dict, str, torch.Tensor]]:
    """(accumulator, name, parameter) of every adapter weight of the requests' runs, each run once: the
    accumulator is the run's, or the staging area its request names."""
    targets = {id(it.run): (it.run, it.run.grads if it.request.stage is None
                            else it.run.staged.setdefault(it.request.stage, {})) for it in items}
    return [(acc, name, p) for run, acc in targets.values() for name, p in run.adapter.named_parameters()]


def add_gradients(params: list[tuple[dict, str, torch.Tensor]], grads) -> None:
    """Add each parameter's gradient (None: it had none) to its accumulator."""
    for (acc, name, _), g in zip(params, grads):
        if g is not None:
            add_gradient(acc, name, g)


def forward_result(it: Prepared, o: LossOutput) -> ForwardResult:
    """A request's result from its loss's output (each datum's log-probs and elementwise values)."""
    outputs, start = [], 0
    lp, el = o.logprobs.tolist(), o.elementwise.tolist()
    for d in it.datums:
        outputs.append(DatumOutput(lp[start:start + d.length], el[start:start + d.length]))
        start += d.length
    return ForwardResult(float(o.loss.detach()), o.metrics, outputs, dict(o.mean_counts))


def add_gradient(acc: dict[str, torch.Tensor], name: str, g: torch.Tensor) -> None:
    """Add a gradient into an accumulator; the first one since the last optim_step is kept as is."""
    if name in acc:
        acc[name] += g
    else:
        acc[name] = g
