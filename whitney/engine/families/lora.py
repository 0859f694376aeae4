"""Per-run LoRA adapters over one shared frozen base, applied to row groups of a mixed batch.

An adapter is plain data: A [r, in] and B [out, r] per adapted module, keyed by the module's
Hugging Face path (per expert, A [E, r, in] and B [E, out, r], for the stacked expert projections of a
MoE layer, keyed by the parameter's path; see experts.py). Which rows of a batch use which adapter is
data too (`RowGroups`), never a "current adapter" attribute on the model, so runs sharing the base
cannot see each other.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from whitney.engine.families.modules import ATTN_PROJECTIONS, LAYER_PROJECTIONS, MLP_PROJECTIONS, UNEMBED, module_path
from whitney.errors import InvalidInput, check
from whitney.protocol.config import EngineConfig
from whitney.protocol.training import LoraConfig

DEFAULT_MAX_RANK = EngineConfig.max_lora_rank
FLOAT32_DELTA_ROWS = 64  # LoRA deltas of at most this many rows are computed in float32 (see lora_delta)


@dataclass
class Adapter:
    """One run's LoRA weights. A[name] is [r, in], B[name] is [out, r]; delta W = scale * B @ A (expert
    projections: A[name] [E, r, in], B[name] [E, out, r], one delta per expert)."""

    config: LoraConfig
    A: dict[str, torch.Tensor]
    B: dict[str, torch.Tensor]
    scale: float = field(init=False)

    def __post_init__(self):
        self.scale = self.config.alpha / self.config.rank

    def names(self) -> list[str]:
        return list(self.A)

    @property
    def device(self) -> torch.device:
        """Where the weights live: their base model's device."""
        return next(iter(self.A.values())).device

    def parameters(self) -> list[torch.Tensor]:
        """Every trainable tensor, in a fixed order: A then B of each module."""
        return [t for name in self.A for t in (self.A[name], self.B[name])]

    def named_parameters(self) -> list[tuple[str, torch.Tensor]]:
        return [(f"{name}.lora_{ab}", t) for name in self.A for ab, t in (("A", self.A[name]), ("B", self.B[name]))]


def _fast_layout(linear_shapes: dict[str, tuple[int, int]]) -> bool:
    """Whether the adaptable linears are the Llama layout of the fast path (llama, qwen2, qwen3), whose
    order of paths (fixing the seeded init) is layer by layer in LAYER_PROJECTIONS order, lm_head last."""
    layer_projections = tuple(f".{p}" for p in LAYER_PROJECTIONS.values())
    return module_path(0, "q_proj") in linear_shapes and all(
        p == UNEMBED or (p.startswith("model.layers.") and p.endswith(layer_projections)) for p in linear_shapes)


def _short(path: str, shape: tuple[int, ...]) -> str:
    """The short name of an adaptable path: its last component (`q_proj`), and for the stacked expert
    projections of a MoE layer (shape (in, out, E)) the last two (`experts.gate_up_proj`), which keeps them
    apart from a shared expert's nn.Linear `down_proj`."""
    return ".".join(path.split(".")[-2:]) if len(shape) == 3 else path.rsplit(".", 1)[-1]


def lora_numel(shape: tuple[int, ...], rank: int) -> int:
    """Parameters of one module's A and B at `rank`: shape is (in, out), or (in, out, E) for E experts."""
    fan_in, fan_out, *experts = shape
    return rank * (fan_in + fan_out) * (experts[0] if experts else 1)


def _kind(path: str) -> str | None:
    """"attn" or "mlp" for a general-path module, from the names of the modules holding it, nearest first
    (`self_attn`, `linear_attn`, `mlp`, `mlp.shared_expert`, ...; None: neither)."""
    for parent in reversed(path.split(".")[:-1]):
        if "attn" in parent or "attention" in parent or "mixer" in parent:
            return "attn"
        if "mlp" in parent or "feed_forward" in parent or "ffn" in parent:
            return "mlp"
    return None


def adaptable_short_names(linear_shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Short module names a run may list in target_modules, checked against the model's real modules
    (`linear_shapes`: every adaptable linear's full path -> (in, out), and every stacked expert
    projection's -> (in, out, E), as `BaseModel.linear_shapes`).
    A short name means every module whose path ends with it, as in PEFT's target_modules."""
    if _fast_layout(linear_shapes):
        present = [p for p in LAYER_PROJECTIONS if module_path(0, p) in linear_shapes]
    else:  # the general path: the model's own names, in its module order
        present = list(dict.fromkeys(_short(p, s) for p, s in linear_shapes.items() if p != UNEMBED))
    if UNEMBED in linear_shapes:
        present.append(UNEMBED)
    return present


def target_module_paths(linear_shapes: dict[str, tuple[int, int]], config: LoraConfig) -> list[str]:
    """Full module paths to adapt (fast path: layer by layer; general path: in the model's module order;
    lm_head last), after validating the config against the model's adaptable linears."""
    valid = adaptable_short_names(linear_shapes)
    fast = _fast_layout(linear_shapes)
    if config.target_modules is not None:
        check(len(config.target_modules) > 0, "target_modules must name at least one module", field="target_modules")
        for name in config.target_modules:
            check(name in valid, f"unknown module {name!r}; this model's adaptable modules are {valid}",
                  field="target_modules")
        short = [n for n in valid if n in config.target_modules]
    else:
        kinds = {} if fast else {_short(p, s): _kind(p)
                                 for p, s in reversed(linear_shapes.items()) if p != UNEMBED}
        short = [n for n in valid if (n == UNEMBED and config.train_unembed)
                 or (config.train_attn and (n in ATTN_PROJECTIONS if fast else kinds.get(n) == "attn"))
                 or (config.train_mlp and (n in MLP_PROJECTIONS if fast else kinds.get(n) == "mlp"))]
        check(len(short) > 0, "train_attn, train_mlp and train_unembed are all false: nothing to train",
              field="train_attn")
    if fast:
        layers = next(i for i in itertools.count() if module_path(i, "q_proj") not in linear_shapes)
        paths = [module_path(i, p) for i in range(layers) for p in short if p != UNEMBED]
    else:
        paths = [p for p, s in linear_shapes.items() if p != UNEMBED and _short(p, s) in short]
    if UNEMBED in short:
        paths.append(UNEMBED)
    return paths


def validate_lora_config(config: LoraConfig, linear_shapes: dict[str, tuple[int, int]],
                         max_rank: int = DEFAULT_MAX_RANK) -> list[str]:
    """Check every field; return the module paths to adapt."""
    check(isinstance(config.rank, int) and not isinstance(config.rank, bool) and 1 <= config.rank <= max_rank,
          f"rank must be an integer from 1 to {max_rank}, got {config.rank!r}", field="rank")
    check(isinstance(config.alpha, (int, float)) and not isinstance(config.alpha, bool)
          and math.isfinite(config.alpha) and config.alpha > 0,
          f"alpha must be a positive finite number, got {config.alpha!r}", field="alpha")
    check(isinstance(config.seed, int) and not isinstance(config.seed, bool) and 0 <= config.seed < 2**63,
          f"seed must be a non-negative integer below 2**63, got {config.seed!r}", field="seed")
    return target_module_paths(linear_shapes, config)


class Adaptable(Protocol):
    """What an adapter is made for: a base model's adaptable modules and device (a `decoder.BaseModel`)."""

    linear_shapes: dict[str, tuple[int, ...]]

    @property
    def device(self) -> torch.device: ...


def init_adapter(base: Adaptable, config: LoraConfig, max_rank: int = DEFAULT_MAX_RANK) -> Adapter:
    """A fresh adapter: A ~ U(-1/sqrt(in), 1/sqrt(in)) from `config.seed` (PEFT's kaiming default), B = 0.

    B = 0 makes a new run compute exactly the base model. The same seed gives the same A on every device:
    A is drawn on the CPU, then moved to the base model's device. An expert projection gets one A and B per
    expert (A [E, r, in], B [E, out, r]).
    """
    paths = validate_lora_config(config, base.linear_shapes, max_rank)
    gen = torch.Generator(device="cpu").manual_seed(config.seed)
    A, B = {}, {}
    for path in paths:
        fan_in, fan_out, *experts = base.linear_shapes[path]  # experts: [E] for an expert projection, else []
        bound = 1.0 / math.sqrt(fan_in)
        a = torch.empty(*experts, config.rank, fan_in, device="cpu").uniform_(-bound, bound, generator=gen)
        A[path] = a.to(base.device).requires_grad_(True)
        B[path] = torch.zeros(*experts, fan_out, config.rank, device=base.device).requires_grad_(True)
    return Adapter(config, A, B)


def copy_adapter(adapter: Adapter, trainable: bool = False) -> Adapter:
    """A detached copy (sampler versions, exports): later training never changes it."""
    A = {k: v.detach().clone().requires_grad_(trainable) for k, v in adapter.A.items()}
    B = {k: v.detach().clone().requires_grad_(trainable) for k, v in adapter.B.items()}
    return Adapter(adapter.config, A, B)


def load_adapter_weights(adapter: Adapter, tensors: dict[str, torch.Tensor]) -> None:
    """Overwrite an adapter's weights in place from `{path}.lora_A` / `{path}.lora_B` tensors."""
    expected = dict(adapter.named_parameters())
    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(expected))[:3]
        raise InvalidInput(f"checkpoint LoRA modules differ from the run's (missing {missing}, unexpected {extra})",
                           field="path")
    for key, t in expected.items():
        if tuple(tensors[key].shape) != tuple(t.shape):
            raise InvalidInput(f"checkpoint tensor {key} has shape {list(tensors[key].shape)}, the run expects "
                               f"{list(t.shape)}", field="path")
    with torch.no_grad():
        for key, t in expected.items():
            t.copy_(tensors[key])


@dataclass
class RowGroups:
    """Which rows of a batch use which adapter (None = base model only).

    Each entry is (start, end, adapter) for contiguous rows [start, end) (training batches, sorted by
    adapter), or (index [R_i], adapter) for scattered rows (the decode batch, where rows join and leave).
    """

    bounds: list[tuple]
    _index: dict = field(default_factory=dict, repr=False, compare=False)  # _batched_index's, per pass

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y + scale * (x @ A^T) @ B^T for each group's rows. x [R, ..., in], y [R, ..., out]."""
        if any(len(entry) == 2 for entry in self.bounds):
            return self._apply_scattered(name, x, y)
        if len(self.bounds) == 1 and _covers(self.bounds[0], name, y):
            # One adapter over every row: its delta added in place (y is a fresh projection output that autograd
            # does not keep), with no second [R, out] tensor (the unembedding's [R, V] above all).
            delta = lora_delta(self.bounds[0][2], name, x)
            return y.add_(delta) if y._base is None else y + delta
        if _accelerated(x):  # the CPU keeps its loop (see _batched): nothing more on its hot path
            groups = [(range(start, end), a) for start, end, a in self.bounds if a is not None and name in a.A]
            if _batched([len(rows) for rows, _ in groups], x):
                return y + self._batched_delta(name, groups, x).reshape(y.shape)
        # Contiguous groups: the deltas (zeros for rows without this module) are concatenated and added
        # once. An in-place add per group would make autograd clone the whole gradient of y per group.
        pieces, covered = [], 0
        for start, end, adapter in self.bounds:
            if adapter is None or name not in adapter.A:
                continue
            if start > covered:
                pieces.append(y.new_zeros((start - covered, *y.shape[1:])))
            pieces.append(lora_delta(adapter, name, x[start:end]))
            covered = end
        if not pieces:
            return y
        if covered < y.shape[0]:
            pieces.append(y.new_zeros((y.shape[0] - covered, *y.shape[1:])))
        return y + (pieces[0] if len(pieces) == 1 else torch.cat(pieces))

    def _batched_delta(self, name: str, groups: list[tuple], x: torch.Tensor) -> torch.Tensor:
        """Every group's delta in two batched matmuls: x [R, ..., in] -> [R, S * out] (S = the middle dims),
        zeros on rows of no group. groups: (rows, adapter), rows a range (contiguous) or an index tensor.

        The G groups' rows are gathered into [G, L, S, in] (L = the largest group; a smaller group repeats
        its last row, whose result is dropped) and their adapters stacked (ranks zero-padded to the largest,
        which adds nothing): [G, L*S, in] @ [G, in, r] -> scale -> @ [G, r, out]. A handful of launches
        whatever G is, where the per-group loop makes ~10 per group: on an accelerator a mixed batch of
        many runs is launch-bound, not arithmetic-bound.
        """
        rows, width = x.shape[0], x.shape[-1]
        gather, place, scale = self._batched_index(groups, rows, x)
        rank = max(a.A[name].shape[0] for _, a in groups)
        a_s = torch.stack([F.pad(a.A[name], (0, 0, 0, rank - a.A[name].shape[0])) for _, a in groups])  # [G, r, in]
        b_s = torch.stack([F.pad(a.B[name], (0, rank - a.B[name].shape[1])) for _, a in groups])  # [G, out, r]
        xs = x.reshape(rows, -1, width)[gather]  # [G, L, S, in]
        g, length, middle = xs.shape[:3]
        h = torch.bmm(xs.reshape(g, length * middle, width), a_s.to(x.dtype).transpose(1, 2))  # [G, L*S, r]
        h = (h * scale).to(x.dtype)  # scale in float32 at least: as x * a Python float
        d = torch.bmm(h, b_s.to(x.dtype).transpose(1, 2))  # [G, L*S, out]
        d = d.reshape(g * length, -1)  # [G*L, S*out]
        return torch.cat([d, d.new_zeros((1, d.shape[1]))])[place]  # [R, S*out]: rows of no group take the zero row

    def _batched_index(self, groups: list[tuple], rows: int, x: torch.Tensor):
        """(gather [G, L], place [R], scale [G, 1, 1]) for _batched_delta on x's device (scale in x's dtype, at
        least float32), made once per pass and groups
        (every linear of a pass asks for the same ones; a host-to-device copy per linear would stall). Built
        where the groups' rows are: on the CPU for ranges, on the device for index tensors (no sync)."""
        key = (tuple((r.start, r.stop) if isinstance(r, range) else id(r) for r, _ in groups), rows, x.device, x.dtype)
        if key not in self._index:
            members = [torch.arange(r.start, r.stop) if isinstance(r, range) else r for r, _ in groups]
            at = members[0].device
            length = max(len(m) for m in members)
            steps = torch.arange(length, device=at)
            gather = torch.stack([m[steps.clamp(max=len(m) - 1)] for m in members])
            place = torch.full((rows,), len(members) * length, device=at)  # the appended zero row
            for i, m in enumerate(members):
                place[m] = i * length + steps[:len(m)]
            scale = torch.tensor([a.scale for _, a in groups], dtype=torch.float64)[:, None, None]
            scale = scale.to(torch.promote_types(x.dtype, torch.float32))
            self._index[key] = tuple(t.to(x.device) for t in (gather, place, scale))
        return self._index[key]

    def _apply_scattered(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Index groups (the decode batch, no autograd): add each group's delta in place (batched on an
        accelerator, as in apply)."""
        if _accelerated(x):
            groups = [(rows, a) for rows, a in self.bounds if a is not None and name in a.A]
            if _batched([len(rows) for rows, _ in groups], x):
                y += self._batched_delta(name, groups, x).reshape(y.shape)
                return y
        for rows, adapter in self.bounds:
            if adapter is not None and name in adapter.A:
                if len(rows) == y.shape[0]:  # every row (in some order): the delta is row-wise, no gather
                    y += lora_delta(adapter, name, x)
                else:
                    y[rows] += lora_delta(adapter, name, x[rows])
        return y

    def rows(self, counts: list[int]) -> "RowGroups":
        """The same contiguous groups after each row r is expanded to counts[r] rows (sequences -> tokens)."""
        starts = [0]
        for c in counts:
            starts.append(starts[-1] + c)
        return RowGroups([(starts[s], starts[e], a) for s, e, a in self.bounds])


def _accelerated(x: torch.Tensor) -> bool:
    """Whether x is off the CPU, where RowGroups may batch its groups' deltas."""
    return x.device.type != "cpu"


def _batched(sizes: list[int], x: torch.Tensor) -> bool:
    """Whether RowGroups.apply takes its adapted groups' deltas (of `sizes` rows each) in batched matmuls
    (_batched_delta) rather than one group at a time: on an accelerator (launch-bound; the CPU's per-row
    throughput is flat, and its loop is the exact path the suite pins), for two groups or more, when padding
    every group to the largest adds at most as many rows as there are (the lm_head's [rows, V] delta above
    all)."""
    if not _accelerated(x) or len(sizes) < 2:
        return False
    return len(sizes) * max(sizes) <= 2 * sum(sizes)


def _covers(bound: tuple, name: str, y: torch.Tensor) -> bool:
    """Whether one contiguous group adapts `name` on every row of y."""
    start, end, adapter = bound
    return adapter is not None and name in adapter.A and start == 0 and end == y.shape[0]


def lora_delta(adapter: Adapter, name: str, x: torch.Tensor, expert: int | None = None) -> torch.Tensor:
    """scale * (x @ A^T) @ B^T for rows x [R, ..., in] -> [R, ..., out] (x's dtype): two thin matmuls, never B @ A.
    With `expert`, A and B are that expert's of an expert projection (A[name][expert], B[name][expert]).

    On the CPU, up to FLOAT32_DELTA_ROWS rows the matmuls run in float32 whatever the compute dtype: that
    few rows make them overhead-bound, where CPU bfloat16 kernels are slower than float32's; above it,
    bfloat16 is the faster. A CPU-only trick: on CUDA they run in the compute dtype.

    B^T is made contiguous ([r, out], a copy of out * r numbers): the gradient of B is then one wide
    [r, R] @ [R, out] product; with B^T as a transposed view autograd computes it as [out, R] @ [R, r], a
    thin-output shape that BLAS runs several times slower (the unembedding's B, [V, r], above all).
    """
    rows = x.numel() // x.shape[-1]
    dt = torch.float32 if rows <= FLOAT32_DELTA_ROWS and x.device.type == "cpu" else x.dtype
    a = (adapter.A[name] if expert is None else adapter.A[name][expert]).to(dt)  # [r, in]
    b = (adapter.B[name] if expert is None else adapter.B[name][expert]).to(dt)  # [out, r]
    return (((x.to(dt) @ a.T) * adapter.scale) @ b.T.contiguous()).to(x.dtype)  # scale the thin [R, r] product
