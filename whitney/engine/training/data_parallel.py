"""Data parallelism over the ranks of a sharded base: each rank runs its share of a pass's rows.

A pass's datums are dealt to the ranks whole, balanced by tokens (`assign_rows`). Each rank runs only its rows
through the sharded layers, then the values of the model every loss reads (the target log-probs; with a teacher,
the learner's and the teacher's full-vocabulary log-probs at the KL pairs) are all-gathered, so that every rank
applies each request's loss to the whole request, as one process does: a loss need not be a sum over datums (a
custom graph, opsd's per-row means and the metrics see every datum). The gradient of the losses in those
values goes back through each rank's own rows only; each rank keeps its share of every adapter gradient in the
run's accumulator, and `sum_gradients` adds the shares up over the ranks (one all-reduce) before an optim_step.
Every rank ends a pass with the same results; after the all-reduce, the same gradients.

Lockstep: FSDP2 gathers each layer's weights around its forward and again around its backward, collectives every
rank must make alike. So every rank runs every pass: a rank holding no row runs one padding row, every adapter of
the pass has its group on every rank (empty where the rank holds none of its rows, so the same weights take
part), a teacher pass runs wherever some request has a teacher, and the backward always starts from the hidden
states too (a zero gradient), so it reaches every layer on every rank.

Shape legend: B rows, N positions of one request, K target candidates, P KL pairs, V vocabulary, W ranks, M the
longest rank's values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from whitney.engine.families.decoder import BaseModel
from whitney.engine.losses.table import LossOutput
from whitney.engine.losses.unembedding import target_logprobs
from whitney.engine.training.batch import (Prepared, adapter_parameters, add_gradients, forward_result,
                                           forward_rows, loss_inputs, student_logprobs, teacher_logprobs)
from whitney.engine.training.run import Run
from whitney.errors import WhitneyError
from whitney.protocol.training import ForwardResult

LOGPROBS, STUDENT_KL, TEACHER_KL = "logprobs", "student_kl", "teacher_kl"  # the values gathered
TRAINED = (LOGPROBS, STUDENT_KL)  # those the gradient flows back through


def assign_rows(lengths_B: list[int], ranks: int) -> list[int]:
    """The rank of each row (whole datums): longest first, each to the rank with the fewest tokens so far
    (ties: the lower rank). Deterministic, so every rank computes the same assignment."""
    load, owner = [0] * ranks, [0] * len(lengths_B)
    for b in sorted(range(len(lengths_B)), key=lambda b: (-lengths_B[b], b)):
        rank = min(range(ranks), key=lambda r: (load[r], r))
        owner[b] = rank
        load[rank] += lengths_B[b]
    return owner


@dataclass
class _Share:
    """One request of the pass as this rank sees it."""

    whole: Prepared  # every datum
    owner: list[int]  # each datum's rank
    mine: Prepared  # this rank's datums only (perhaps none)

    def rows(self, name: str) -> list[int]:
        """Each datum's rows of a gathered value: its positions (log-probs) or its KL pairs."""
        if name == LOGPROBS:
            return [d.length for d in self.whole.datums]
        return [len(student) for student, _ in self.whole.rows]

    def width(self, name: str, vocab: int) -> int:
        if name != LOGPROBS:
            return vocab
        targets = self.whole.datums[0].inputs["target_tokens"]
        return 1 if targets.dim() == 1 else int(targets.shape[1])

    def names(self) -> tuple[str, ...]:
        return (LOGPROBS, STUDENT_KL, TEACHER_KL) if self.whole.spec.teacher else (LOGPROBS,)

    def local_rows(self, name: str, rank: int) -> torch.Tensor:
        """Where `rank`'s rows of a value sit in the whole request's value, in their order there."""
        counts, start, out = self.rows(name), 0, []
        for n, r in zip(counts, self.owner):
            if r == rank:
                out.append(torch.arange(start, start + n))
            start += n
        return torch.cat(out) if out else torch.zeros(0, dtype=torch.int64)


def compute_split_pass(base: BaseModel, items: list[Prepared], backward: bool
                       ) -> list[ForwardResult | WhitneyError]:
    """`batch.compute_pass` with the rows split over the ranks of the default process group (every rank calls
    it with the same `items`): each request's result, on every rank; each rank's share of the gradients added
    to the runs' accumulators (see `sum_gradients`)."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    owner = assign_rows([d.length for it in items for d in it.datums], ranks)
    shares, start = [], 0
    for it in items:
        own = owner[start:start + len(it.datums)]
        keep = [j for j, r in enumerate(own) if r == rank]
        shares.append(_Share(it, own, replace(it, datums=[it.datums[j] for j in keep],
                                              rows=it.rows and [it.rows[j] for j in keep])))
        start += len(it.datums)
    mine = [s.mine for s in shares]
    whole_inputs = [loss_inputs(s.whole, base.device) for s in shares]  # each request's (targets, inputs)
    teacher_kl = teacher_logprobs(base, mine, pad=True)
    with torch.set_grad_enabled(backward):
        hidden, flat = forward_rows(base, mine, pad=True)  # [B, T, D], [sum N, D] of this rank's rows
        local, start = [], 0
        for share, (_, inputs), tk in zip(shares, whole_inputs, teacher_kl):
            n = sum(d.length for d in share.mine.datums)
            local.append(_model_values(base, share, inputs, flat[start:start + n], tk, rank))
            start += n
    whole = _all_gather(shares, local, base.lm_head.shape[0], base.device)
    outputs, leaves = [], []
    with torch.set_grad_enabled(backward):
        for share, values, (targets, inputs) in zip(shares, whole, whole_inputs):
            lp = values[LOGPROBS].view(targets.shape).requires_grad_(backward)  # [N] or [N, K]
            if share.whole.spec.teacher:
                inputs[STUDENT_KL] = values[STUDENT_KL].requires_grad_(backward)  # [P, V]
                inputs[TEACHER_KL] = values[TEACHER_KL]
            leaves.append({LOGPROBS: lp, STUDENT_KL: inputs.get(STUDENT_KL)})
            try:
                outputs.append(share.whole.spec.fn(lp, inputs, share.whole.config))
            except WhitneyError as e:  # a loss refusing its values only now (a custom graph): it alone fails
                outputs.append(e)
    ran = [i for i, o in enumerate(outputs) if isinstance(o, LossOutput)]
    if backward and ran:
        _backward([shares[i] for i in ran], [outputs[i] for i in ran], [leaves[i] for i in ran],
                  [local[i] for i in ran], hidden, rank)
    return [o if isinstance(o, WhitneyError) else forward_result(s.whole, o) for s, o in zip(shares, outputs)]


def _model_values(base: BaseModel, share: _Share, whole_inputs: dict[str, torch.Tensor], h: torch.Tensor,
                  teacher_kl, rank: int) -> dict[str, torch.Tensor]:
    """This rank's values of one request, from its hidden rows h [n, D]: log-probs [n, K] and, with a teacher,
    student_kl and teacher_kl [p, V]. Where the loss knows its gradient in the log-probs from its inputs alone
    (`whole_inputs`, the whole request's), the unembedding takes this rank's rows of it in the same pass (as
    `batch.compute_pass` does)."""
    mine = share.mine
    if not mine.datums:
        return {}
    targets, inputs = loss_inputs(mine, base.device)
    known = None
    if share.whole.spec.gradient and torch.is_grad_enabled():
        rows = share.local_rows(LOGPROBS, rank).to(base.device)
        known = share.whole.spec.gradient(whole_inputs, share.whole.config)[rows]
    lp = target_logprobs(base, h, targets, mine.adapter, known)
    out = {LOGPROBS: lp.reshape(len(lp), -1)}
    if mine.spec.teacher:
        out[STUDENT_KL] = student_logprobs(base, mine, h, inputs["kl_index"])
        out[TEACHER_KL] = torch.cat(teacher_kl)
    return out


def _all_gather(shares: list[_Share], local: list[dict[str, torch.Tensor]], vocab: int, device: torch.device
                ) -> list[dict[str, torch.Tensor]]:
    """Every request's values whole (its datums in order), on every rank, from each rank's share of them: one
    all-gather of each rank's values flattened into one float32 buffer (padded to the longest, [W, M])."""
    rank, ranks = dist.get_rank(), dist.get_world_size()
    layout = [[(i, name, sum(n for n, r in zip(s.rows(name), s.owner) if r == k), s.width(name, vocab))
               for i, s in enumerate(shares) for name in s.names()] for k in range(ranks)]
    sizes = [sum(rows * width for _, _, rows, width in chunks) for chunks in layout]
    mine = [local[i][name].detach().reshape(-1) for i, name, rows, _ in layout[rank] if rows]
    buffer = torch.zeros(max(sizes), dtype=torch.float32, device=device)
    if mine:
        torch.cat(mine, out=buffer[:sizes[rank]])
    gathered = torch.empty(ranks * max(sizes), dtype=torch.float32, device=device)
    dist.all_gather_single(gathered, buffer)
    gathered = gathered.view(ranks, max(sizes))  # [W, M]
    chunks: dict[tuple[int, str], list[torch.Tensor]] = {}  # (request, value) -> each rank's rows
    for k, layout_k in enumerate(layout):
        at = 0
        for i, name, rows, width in layout_k:
            chunks.setdefault((i, name), []).append(gathered[k, at:at + rows * width].view(rows, width))
            at += rows * width
    out = []
    for i, s in enumerate(shares):
        values = {}
        for name in s.names():
            cursor, pieces = [0] * ranks, []
            for n, r in zip(s.rows(name), s.owner):
                pieces.append(chunks[(i, name)][r][cursor[r]:cursor[r] + n])
                cursor[r] += n
            values[name] = torch.cat(pieces)  # [rows of the request, width], a copy: a leaf of its own
        out.append(values)
    return out


def _backward(shares: list[_Share], outputs: list[LossOutput], leaves: list[dict], local: list[dict],
              hidden: torch.Tensor, rank: int) -> None:
    """The gradient of the summed losses in the gathered values, sent back through this rank's rows; each run's
    share of its adapter gradient added to its accumulator (or its request's staging area)."""
    wrt = [(j, name) for j, values in enumerate(leaves) for name in TRAINED if values[name] is not None]
    grads = torch.autograd.grad(sum(o.loss for o in outputs), [leaves[j][name] for j, name in wrt],
                                allow_unused=True)
    roots, seeds = [], []
    for (j, name), g in zip(wrt, grads):
        if g is not None and name in local[j]:
            rows = shares[j].local_rows(name, rank).to(g.device)
            roots.append(local[j][name])
            seeds.append(g.reshape(len(g), -1)[rows].view_as(local[j][name]))
    if hidden.requires_grad:  # every rank's backward runs through every layer (FSDP2's gathers), rows or not
        roots.append(hidden)
        seeds.append(torch.zeros_like(hidden))
    if roots:
        params = adapter_parameters([s.whole for s in shares])
        add_gradients(params, torch.autograd.grad(roots, [p for _, _, p in params], seeds, allow_unused=True))


def sum_gradients(runs: list[Run]) -> None:
    """Sum each run's gradient accumulator over the ranks of the default process group, in place on every rank
    (one all-reduce; a weight without a gradient on a rank counts as zero there, as optim_step counts it). Every
    rank calls it with the same runs, right before their optim_steps, which consume the sums."""
    if dist.get_world_size() == 1 or not runs:
        return
    params = [(run, name, p) for run in runs for name, p in run.adapter.named_parameters()]
    flat = torch.cat([(run.grads[name] if name in run.grads else torch.zeros_like(p)).reshape(-1).float()
                      for run, name, p in params])
    dist.all_reduce(flat)
    for (run, name, p), part in zip(params, flat.split([p.numel() for _, _, p in params])):
        run.grads[name] = part.view_as(p).to(p.dtype)
