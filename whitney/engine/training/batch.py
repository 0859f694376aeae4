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
    teacher_kl = _teacher_logprobs(base, items)
    lengths = [d.length for it in items for d in it.datums]
    T = max(lengths)
    tokens = torch.zeros(len(lengths), T, dtype=torch.int64, device="cpu")  # [B, T], right-padded
    for row, d in enumerate(d for it in items for d in it.datums):
        tokens[row, : d.length] = d.tokens
    tokens = tokens.to(base.device)  # filled on the CPU, one copy to the device
    bounds, row = [], 0
    for it in items:
        bounds.append((row, row + len(it.datums), it.adapter))
        row += len(it.datums)
    groups = RowGroups(bounds)
    with torch.set_grad_enabled(backward):
        images = [d.images for it in items for d in it.datums]  # per row, its processed images
        hidden = base.forward_hidden(tokens, groups, images)  # [B, T, D]
        valid = (torch.arange(T, device=base.device)[None, :]
                 < torch.tensor(lengths, device=base.device)[:, None])  # [B, T]
        flat = hidden[valid]  # [sum N, D], row-major: each request's tokens are contiguous
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
    return [o if isinstance(o, WhitneyError) else _result(it, o) for it, o in zip(items, outputs)]


def _loss(base: BaseModel, it: Prepared, h: torch.Tensor, teacher_kl) -> LossOutput:
    """Apply the request's loss to its hidden rows h [N, D] (all its datums, concatenated, moved here from
    the CPU, where they were validated, to the device), with the inputs loss_table.py's contract names."""
    dev = base.device
    targets = torch.cat([d.inputs["target_tokens"] for d in it.datums]).to(dev)  # [N] or [N, K]
    per_position = [k for k in it.datums[0].inputs if it.spec.inputs[k].rows == "N"]
    inputs = {k: torch.cat([d.inputs[k] for d in it.datums]).to(dev) for k in per_position}
    inputs.update({k: torch.stack([d.inputs[k] for d in it.datums]).to(dev)  # [B]: one value per datum
                   for k in it.datums[0].inputs if it.spec.inputs[k].rows == SCALAR})
    lengths = torch.tensor([d.length for d in it.datums], device="cpu")
    inputs["datum_index"] = torch.repeat_interleave(torch.arange(len(it.datums), device="cpu"),
                                                    lengths).to(dev)  # [N]
    if it.spec.teacher:  # the KL pairs: learner full-vocabulary log-probs here, the teacher's from its pass
        starts = (torch.cumsum(lengths, 0) - lengths).tolist()
        pos = torch.cat([s_pos + start for (s_pos, _), start in zip(it.rows, starts)]).to(dev)  # [P]
        inputs["kl_index"] = pos
        inputs["student_kl"] = full_logprobs(base.unembed(h[pos], RowGroups([(0, len(pos), it.adapter)])))
        inputs["teacher_kl"] = torch.cat(teacher_kl)  # [P, V]
    # A loss linear in the log-probs knows its gradient now: the unembedding takes it in the same pass.
    known = it.spec.gradient(inputs, it.config) if it.spec.gradient and torch.is_grad_enabled() else None
    lp = target_logprobs(base, h, targets, it.adapter, known)  # [N] or [N, K], logits never all at once
    return it.spec.fn(lp, inputs, it.config)


def _teacher_logprobs(base: BaseModel, items: list[Prepared]) -> list[list[torch.Tensor] | None]:
    """Teacher streams (a loss whose entry names one) through the same weights, no gradient: [K, V]
    log-probs at each datum's paired teacher positions."""
    out: list[list[torch.Tensor] | None] = [None] * len(items)
    rows = [(i, d.inputs[it.spec.teacher], pair[1]) for i, it in enumerate(items) if it.spec.teacher
            for d, pair in zip(it.datums, it.rows)]
    if not rows:
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
    targets = {id(it.run): (it.run, it.run.grads if it.request.stage is None
                            else it.run.staged.setdefault(it.request.stage, {})) for it in items}
    params = [(acc, name, p) for run, acc in targets.values() for name, p in run.adapter.named_parameters()]
    total = sum(o.loss for o in outputs)
    grads = torch.autograd.grad(total, [p for _, _, p in params], allow_unused=True)
    for (acc, name, _), g in zip(params, grads):
        if g is not None:
            add_gradient(acc, name, g)


def _result(it: Prepared, o: LossOutput) -> ForwardResult:
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
