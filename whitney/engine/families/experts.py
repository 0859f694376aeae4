"""LoRA on the experts of Mixture-of-Experts layers, per row group, for one pass (the general path).

transformers 5 keeps a MoE layer's experts as one module (a class decorated with
`use_experts_implementation`: Qwen3-MoE, Qwen3.5-MoE, gpt-oss, ...) holding stacked 3D parameters, not
nn.Linear: `gate_up_proj` (`up_proj` when the module `has_gate` is false) and `down_proj`, each
[E, out, in], or [E, in, out] when the module `is_transposed` (gpt-oss), with biases [E, out] when it
`has_bias`. The MoE block routes first and then calls experts(hidden_states [N, D], top_k_index [N, K],
top_k_weights [N, K]) on its tokens flattened row-major, whatever implementation the config picks.

Each expert projection is adapted per expert: A [E, r, in], B [E, out, r], delta W[e] = scale * B[e] @ A[e]
(PEFT's `target_parameters` layout maps onto this one; see checkpoint.export_peft). For one pass
(`adapted_experts`), each adapted experts module computes with `experts_forward` instead of its own
forward: the same routing (an input, never changed), the module's own weights, biases and `_apply_gate`,
plus each token's group's delta; its own forward is restored on exit, also on an exception. The router
is not adaptable: routing stays the base model's decision (a LoRA on a top-k choice has no gradient).

Shape legend: B rows, T positions, N = B * T tokens (row-major), K experts per token, S = N * K
(token, expert) pairs, E experts, D hidden, r rank, G groups of rows.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F

from whitney.engine.families.lora import RowGroups, lora_delta

EXPERT_ATTRIBUTES = ("num_experts", "has_gate", "has_bias", "is_transposed")  # what the decorator sets


def expert_projections(module: torch.nn.Module) -> dict[str, tuple[int, int, int]]:
    """The adaptable projections of a stacked-experts module, in its parameter order: name -> (in, out, E);
    empty for any other module."""
    if not all(hasattr(module, a) for a in EXPERT_ATTRIBUTES):
        return {}
    wanted = ("gate_up_proj" if module.has_gate else "up_proj", "down_proj")
    out = {}
    for name, p in module.named_parameters(recurse=False):
        if name in wanted and p.dim() == 3:
            experts, first, second = p.shape  # [E, in, out] transposed, else [E, out, in]
            out[name] = (first, second, experts) if module.is_transposed else (second, first, experts)
    return out if len(out) == len(wanted) else {}


def _slots(groups: RowGroups, rows: int) -> torch.Tensor:
    """The group index of each row [B] (CPU); G (past the last group) for rows no group lists."""
    slot = torch.full((rows,), len(groups.bounds), dtype=torch.int64, device="cpu")
    for g, entry in enumerate(groups.bounds):
        if len(entry) == 3:
            slot[entry[0]:entry[1]] = g
        else:
            slot[entry[0].cpu()] = g
    return slot


def _project(module: torch.nn.Module, name: str, expert: int, x: torch.Tensor, key: str | None,
             counts: list[int], adapters: list) -> torch.Tensor:
    """One expert's projection `name` of its pairs x [n, in] -> [n, out], sorted by group (counts[g] pairs of
    group g), plus each group's delta when its adapter has `key`."""
    weight = getattr(module, name)[expert]
    y = x @ weight if module.is_transposed else F.linear(x, weight)
    if module.has_bias:
        y = y + getattr(module, f"{name}_bias")[expert]
    if key is None:
        return y
    pieces, offset, adapted = [], 0, False
    for g, n in enumerate(counts):
        if n == 0:
            continue
        adapter = adapters[g] if g < len(adapters) else None
        if adapter is not None and key in adapter.A:
            pieces.append(lora_delta(adapter, key, x[offset:offset + n], expert))
            adapted = True
        else:
            pieces.append(y.new_zeros((n, y.shape[-1])))
        offset += n
    if not adapted:
        return y
    # concatenated and added once, as in RowGroups.apply (no in-place add into a tensor autograd keeps)
    return y + (pieces[0] if len(pieces) == 1 else torch.cat(pieces))


def experts_forward(module: torch.nn.Module, keys: dict[str, str], groups: RowGroups, rows: list[int],
                    hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """What the experts module computes on tokens hidden_states [N, D] routed to top_k_index [N, K] with
    top_k_weights [N, K], with each group's LoRA on the projections in `keys` (projection -> adapter key).
    rows: [B], the pass's rows (the tokens are B rows of T). Returns [N, D] in hidden_states' dtype."""
    slot_of_row = _slots(groups, rows[0])  # [B]
    tokens, width = hidden_states.shape
    k = top_k_index.shape[-1]
    experts = module.num_experts
    rows = slot_of_row.shape[0]
    assert tokens % rows == 0, f"{tokens} tokens are not {rows} rows of equal length"
    per_expert = len(groups.bounds) + 1  # the groups, then "no group"
    slot = slot_of_row.to(hidden_states.device).repeat_interleave(tokens // rows * k)  # [S], pairs token-major
    key = top_k_index.reshape(-1) * per_expert + slot  # [S]
    order = torch.argsort(key, stable=True)  # [S]: pairs by expert, then by group, then by token
    counts = torch.bincount(key, minlength=experts * per_expert).tolist()  # the one host sync
    assert len(counts) == experts * per_expert, "an expert index past num_experts (expert parallelism?)"
    x = hidden_states[order // k]  # [S, D], sorted
    adapters = [entry[-1] for entry in groups.bounds]
    first = "gate_up_proj" if module.has_gate else "up_proj"
    outs, start = [], 0
    for e in range(experts):
        seg = counts[e * per_expert:(e + 1) * per_expert]
        n = sum(seg)
        if n == 0:
            continue
        h = _project(module, first, e, x[start:start + n], keys.get(first), seg, adapters)  # [n, 2I] or [n, I]
        h = module._apply_gate(h) if module.has_gate else module.act_fn(h)  # [n, I]
        y = _project(module, "down_proj", e, h, keys.get("down_proj"), seg, adapters)  # [n, D]
        if getattr(module, "has_post_expert_norm", False):
            y = module.post_expert_norm(y)
        outs.append(y)
        start += n
    weighted = torch.cat(outs) * top_k_weights.reshape(-1)[order].unsqueeze(-1)  # [S, D]
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.shape[0], device=order.device)
    # back to token-major pairs, then each token's K experts summed (no atomics: deterministic on CUDA)
    return weighted[inverse].view(tokens, k, width).sum(dim=1).to(hidden_states.dtype)


@contextmanager
def adapted_experts(hf: torch.nn.Module, paths: list[str], groups: RowGroups, rows: list[int]):
    """For one pass (B = rows[0], set once the pass starts): each experts module with a projection in
    `paths` (full parameter paths, as adapter keys) computes `experts_forward` with `groups`; restored on
    exit."""
    by_module: dict[str, dict[str, str]] = {}
    for path in paths:
        module_path, name = path.rsplit(".", 1)
        by_module.setdefault(module_path, {})[name] = path
    patched = []
    try:
        for module_path, keys in by_module.items():
            module = hf.get_submodule(module_path)
            assert "forward" not in vars(module), f"{module_path} is already adapted (two passes overlap?)"
            module.forward = partial(experts_forward, module, keys, groups, rows)
            patched.append(module)
        yield
    finally:
        for module in patched:
            del module.forward  # the class's own forward again
