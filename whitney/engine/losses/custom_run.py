"""A checked custom loss (custom.py) planned from a datum's shapes, budgeted per request, then run.

`plan_for(program, inputs)` walks the graph over meta tensors (a shape and a dtype, no storage) standing for
one datum's inputs, before any of the datum's values are touched: every node's result is sized from all its
arguments, positional and keyword, as torch itself reads them (sizes, `start=`/`end=`/`step=`, index lists,
nested index tuples, `expand`/`repeat`/`reshape` sizes...), and a node that would make more than the size
bound, or all of a datum's nodes more than the total bound, is InvalidInput naming the node and the bound.
Python numbers are computed as they will be (they come from shapes, never from values: a number read off a
tensor's values is refused). The plan is exact: the real run makes the shapes the plan found, except after
a boolean mask, whose plan is its worst case (every element kept) and whose real run is checked node by
node against it.

The plan also counts the graph's work, in elements touched (the budget model, docs/API.md):
  a node      NODE_WORK (its dispatch) + the elements of every tensor it reads, views as their shape (an
              expand()ed input counts every element it stands for, so a reduction over an expanded view costs
              what it reads, not what it makes) + the elements of every tensor it makes; reading only a
              tensor's metadata (shape, size, ndim, numel, dtype) is NODE_WORK
  a datum     the sum over its nodes (a graph with a boolean mask pays NODE_WORK again per node: its real run
              is checked node by node)
  a request   the sum over its datums, and PLAN_WORK per node for each datum shape it brings (planning), at
              most WORK_BASE + WORK_PER_LOGPROB x its log-probs (sum over datums of N, or N x K): `check_budget`,
              which stops at the first datum over it
Shapes: N positions of a datum, K candidates (rank 2).
"""

from __future__ import annotations

import math
import operator
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from whitney.engine.losses.custom import Program, Step, flat, refuse, resolve
from whitney.errors import InvalidInput

# Size bounds: a tensor a node makes holds at most max(MIN_ELEMENTS, ELEMENT_FACTOR x the datum's largest
# input) elements, and all of one datum's nodes together TOTAL_FACTOR times that.
MIN_ELEMENTS = 1 << 16
ELEMENT_FACTOR = 4
TOTAL_FACTOR = 64
# Work: one unit is one element read or written (from well under a nanosecond, contiguous and elementwise, to
# about 15 ns, a reduction over an expanded view, on a CPU). NODE_WORK is a node's fixed cost on each datum
# (dispatch, a few microseconds); PLAN_WORK a node's planning on each datum shape a request brings (meta
# tensors: tens of microseconds). A request may spend WORK_BASE (a small request with a full 256-node graph)
# plus WORK_PER_LOGPROB per log-prob it computes (about 16 passes over each), so a graph costs at most a few
# tens of microseconds of CPU per token the request is charged for.
NODE_WORK = 1 << 10
PLAN_WORK = 1 << 12
WORK_BASE = 1 << 21
WORK_PER_LOGPROB = 1 << 12
# The scheduler shares the engine among runs by positions: a datum's graph work counts as this many elements
# touched per position (a position's forward and backward on the smallest served models is worth more).
WORK_PER_POSITION = 1 << 12
MAX_PLANS = 1024  # per program (more datum shapes than a request can bring); past it, plans are forgotten

# Ops whose result has the broadcast shape of their tensor arguments (one tensor: its own shape); their dtype,
# and any error from a bad dim or dtype, come from the op run on one-element stand-ins (faster than meta).
_SAME_SHAPE = ("exp", "log", "log1p", "expm1", "log2", "exp2", "abs", "neg", "sqrt", "rsqrt", "square", "sign",
               "sigmoid", "tanh", "relu", "floor", "ceil", "round", "trunc", "reciprocal", "isfinite", "isnan",
               "isinf", "logical_not", "nan_to_num", "softmax", "log_softmax", "cumsum", "cumprod", "zeros_like",
               "ones_like", "full_like", "clamp", "clip", "clamp_min", "clamp_max", "float", "double", "long",
               "bool", "detach", "contiguous", "clone", "to", "add", "sub", "mul", "div", "true_divide", "pow",
               "minimum", "maximum", "fmin", "fmax", "where", "eq", "ne", "lt", "le", "gt", "ge", "logical_and",
               "logical_or", "logical_xor", "lerp", "xlogy", "masked_fill", "remainder", "fmod")
ELEMENTWISE = frozenset({*_SAME_SHAPE, *(f"torch.{n}" for n in _SAME_SHAPE),
                         *(f"operator.{n}" for n in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "eq",
                                                     "ne", "lt", "le", "gt", "ge", "and_", "or_", "xor", "neg",
                                                     "pos", "abs", "invert")),
                         "torch._C._nn.softplus", "torch.nn.functional.softplus", "torch._C._nn.log_sigmoid",
                         "torch.nn.functional.logsigmoid", "torch.nn.functional.log_softmax",
                         "torch.nn.functional.softmax", "torch.nn.functional.relu", "torch.nn.functional.silu",
                         "torch._C._special.special_expit", "torch.special.expit"})


def _norm_shape(x, p="fro", dim=None, keepdim=False, dtype=None):
    return torch.amax(x, () if dim is None else dim, keepdim)


def _spread_shape(x, *args, dim=None, unbiased=None, correction=None, keepdim=False):
    """std and var: (x), (x, unbiased), (x, dim, unbiased, keepdim), or by keyword."""
    if args and not isinstance(args[0], bool):
        dim, args = args[0], args[1:]
        keepdim = args[1] if len(args) > 1 else keepdim
    return torch.amax(x, () if dim is None else dim, keepdim)


# Reductions whose meta form is slow, sized by one that reduces the same dims (dtype from stand-ins).
_SHAPED_LIKE = {"logsumexp": torch.amax, "torch.logsumexp": torch.amax, "mean": torch.sum, "torch.mean": torch.sum,
                "norm": _norm_shape, "torch.norm": _norm_shape, "std": _spread_shape, "torch.std": _spread_shape,
                "var": _spread_shape, "torch.var": _spread_shape}
METADATA = frozenset({"getattr", "size", "dim", "numel"})  # read a tensor's metadata only
_FAILURES = (RuntimeError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError, AttributeError,
             KeyError, NotImplementedError)


@dataclass(frozen=True)
class Plan:
    """One datum shape's plan: what each step makes (elements, per step), its work, whether a mask makes it
    depend on values (then each node of the real run is planned again on the real shapes)."""

    made: array  # int64 per step
    work: int  # elements touched, NODE_WORK per node included
    cap: int  # the size bound of one tensor for this datum
    masked: bool

    @property
    def cost(self) -> int:
        """What the datum is charged: its work, and for a masked graph the per-node check of its real run."""
        return self.work + (NODE_WORK * len(self.made) if self.masked else 0)


def budget(logprobs: int) -> int:
    """The work a request computing `logprobs` log-probs (sum over datums of N, or N x K) may spend."""
    return WORK_BASE + WORK_PER_LOGPROB * logprobs


def signature(values: list[torch.Tensor]) -> tuple:
    return tuple((tuple(v.shape), v.dtype) for v in values)


def plan_for(program: Program, inputs: tuple[tuple[tuple[int, ...], torch.dtype], ...]) -> Plan:
    """The plan of `program` over one datum's inputs ((shape, dtype) each, in `program.inputs` order), made
    once per shape (kept on the program). A node over a bound, or failing on these shapes, is InvalidInput
    naming it; so is a loss that is not a scalar float or a metric that is not one number."""
    plan = program.plans.get(inputs)
    if plan is None:
        plan = _plan(program, inputs)
        if len(program.plans) >= MAX_PLANS:
            program.plans.clear()
        program.plans[inputs] = plan
    return plan


def _plan(program: Program, inputs: tuple) -> Plan:
    env: dict[str, Any] = {name: torch.empty(shape, dtype=dtype, device="meta")
                           for (name, _), (shape, dtype) in zip(program.inputs, inputs)}
    cap = max(MIN_ELEMENTS, ELEMENT_FACTOR * max(math.prod(shape) for shape, _ in inputs))
    made, work, total, masked = [], 0, 0, False
    for step in program.steps:
        where = f"node {step.index} ({step.name!r}, {step.target})"
        args, kwargs = resolve(step.args, env), {k: resolve(v, env) for k, v in step.kwargs.items()}
        out, dependent = plan_node(step, args, kwargs, where)
        masked = masked or dependent
        n = _made(out, cap, where)
        made.append(n)
        total += n
        if total > TOTAL_FACTOR * cap:
            raise refuse(where, f"the graph's tensors would exceed {TOTAL_FACTOR * cap} elements in all "
                                f"({TOTAL_FACTOR} x the bound of one tensor)")
        work += node_work(step, args, kwargs, n)
        env[step.name] = out
    _check_output(program, env)
    return Plan(array("q", made), work, cap, masked)


def node_work(step: Step, args: tuple, kwargs: dict, made: int) -> int:
    """NODE_WORK, and for a node that reads values the elements of its tensor arguments and of its result."""
    if step.target in METADATA:
        return NODE_WORK
    return NODE_WORK + sum(int(t.numel()) for t in flat(args + tuple(kwargs.values()))
                           if isinstance(t, torch.Tensor)) + made


def _made(out: Any, cap: int, where: str) -> int:
    """The elements of the tensors a node makes (each at most `cap`); a complex or oversized number is refused."""
    n = 0
    for t in flat((out,)):
        if isinstance(t, complex) or isinstance(t, torch.Tensor) and t.is_complex():
            raise refuse(where, "makes a complex number; a custom loss is real-valued")
        if isinstance(t, torch.Tensor):
            if t.numel() > cap:
                raise refuse(where, f"would make a tensor of {t.numel()} elements, over the bound of {cap} (at "
                                    f"least {MIN_ELEMENTS}, else {ELEMENT_FACTOR} x the datum's largest input)")
            n += int(t.numel())
        elif isinstance(t, int) and abs(t) > 2**63:
            raise refuse(where, "makes an integer over 2**63")
    return n


def _check_output(program: Program, env: dict[str, Any]) -> None:
    where = f"node {program.output[0]} ({program.output[1]!r}, output)"
    loss = resolve(program.loss, env)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise refuse(where, f"the loss must be a scalar floating-point tensor, got {shape}")
    for key, ref in program.metrics.items():
        v = resolve(ref, env)
        if not (isinstance(v, torch.Tensor) and v.numel() == 1
                or isinstance(v, (int, float)) and not isinstance(v, bool)):
            raise refuse(where, f"metric {key!r} must be a one-element tensor or a number")


# ---- one node over meta tensors ------------------------------------------------------------------------

def plan_node(step: Step, args: tuple, kwargs: dict, where: str) -> tuple[Any, bool]:
    """What a node makes, as meta tensors (and Python numbers), from its arguments (meta tensors and numbers);
    and whether its shape depends on values (indexing by a boolean mask: planned as if every element is kept).
    Nothing here allocates a tensor's elements or computes on values. The allow-list's rules are checked first."""
    admit(step, args, kwargs, where)
    if step.rule == "size":
        kwargs = {**kwargs, "device": "meta"}
    tensors = [v for v in flat(args + tuple(kwargs.values())) if isinstance(v, torch.Tensor)]
    dependent = False
    try:
        if step.rule != "size" and not tensors:  # Python numbers (shapes, constants)
            return step.fn(*args, **kwargs), False
        if step.target in ELEMENTWISE:
            shapes = [t.shape for t in tensors]
            shape = shapes[0] if all(s == shapes[0] for s in shapes) else torch.broadcast_shapes(*shapes)
            dtype = _stand_in_dtype(step.fn, args, kwargs)
            return torch.empty(shape, dtype=dtype, device="meta"), False
        if step.target in _SHAPED_LIKE:
            dtype = _stand_in_dtype(step.fn, args, kwargs)  # and its own errors (a bad dim, an integer mean)
            return _SHAPED_LIKE[step.target](*args, **kwargs).to(dtype), False
        if step.target in ("torch.cat", "torch.stack"):
            return _concat(step, args, kwargs), False
        if step.target in ("operator.getitem", "getitem") and isinstance(args[0], torch.Tensor):
            index, dependent = _worst_index(args[0], args[1], where)
            if isinstance(index, list):  # one flat index list: rows of dim 0 (as meta's index_select, fast)
                return torch.index_select(args[0], 0, torch.empty(len(index), dtype=torch.long, device="meta")), False
            return operator.getitem(args[0], index), dependent
        return step.fn(*args, **kwargs), False
    except InvalidInput:
        raise
    except _FAILURES as e:
        raise refuse(where, f"failed: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from None


def _concat(step: Step, args: tuple, kwargs: dict) -> torch.Tensor:
    """torch.cat or torch.stack of tensors that agree in shape (cat: but for `dim`), as a meta tensor."""
    tensors = list(args[0] if args else kwargs.get("tensors", ()))
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    dtype = _stand_in_dtype(step.fn, args, kwargs)  # and a bad dim's error
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"{step.target} takes a non-empty list of tensors")
    first = list(tensors[0].shape)
    if step.target == "torch.stack":
        if any(list(t.shape) != first for t in tensors):
            raise RuntimeError("stack expects each tensor to be equal size")
        d = dim % (len(first) + 1)
        return torch.empty(first[:d] + [len(tensors)] + first[d:], dtype=dtype, device="meta")
    d = dim % max(len(first), 1)
    if any(t.dim() != len(first) or [s for i, s in enumerate(t.shape) if i != d] != first[:d] + first[d + 1:]
           for t in tensors):
        raise RuntimeError(f"Sizes of tensors must match except in dimension {dim}")
    first[d] = sum(int(t.shape[d]) for t in tensors)
    return torch.empty(first, dtype=dtype, device="meta")


def _stand_in_dtype(fn, args: tuple, kwargs: dict) -> torch.dtype:
    """The dtype an op makes, from the op run on one-element CPU tensors of its arguments' ranks and dtypes."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return torch.ones((1,) * v.dim(), dtype=v.dtype)
        if isinstance(v, (list, tuple)):
            return type(v)(one(x) for x in v)
        return v
    out = fn(*(one(a) for a in args), **{k: one(v) for k, v in kwargs.items()})
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"makes {type(out).__name__}, not a tensor")
    return out.dtype


def _worst_index(x: torch.Tensor, index: Any, where: str) -> tuple[Any, bool]:
    """An index as meta indexing takes it: a boolean mask becomes the indices of all its elements (the most it
    can keep; a 0-d mask, one new dimension). Integers in index lists must be in range of the dimension they
    index (out of range is a device fault on an accelerator). (index, whether a mask was there)."""
    if isinstance(index, list) and not all(isinstance(v, int) and not isinstance(v, bool) for v in index):
        raise refuse(where, "an index list is a flat list of integers (to index several dimensions, a tuple)")
    parts = list(index) if isinstance(index, tuple) else [index]
    masked = any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)
    out, dim = [], 0
    used = sum(p.dim() if isinstance(p, torch.Tensor) and p.dtype == torch.bool else 1 for p in parts
               if p is not None and p is not Ellipsis)
    for p in parts:
        if p is None:
            out.append(p)
        elif p is Ellipsis:
            out.append(p)
            dim += max(0, x.dim() - used)
        elif isinstance(p, torch.Tensor) and p.dtype == torch.bool:
            if p.dim() == 0:
                out.append(None)
            else:
                out += [torch.empty(p.numel(), dtype=torch.long, device="meta")] * p.dim()
            dim += p.dim()
        else:
            if isinstance(p, list):
                size = x.shape[dim] if dim < x.dim() else 0
                bad = [v for v in flat((p,)) if not isinstance(v, int) or isinstance(v, bool) or not -size <= v < size]
                if bad:
                    raise refuse(where, f"index list entries are integers in range of the dimension they index "
                                        f"(size {size}), got {bad[0]!r}")
            out.append(p)
            dim += 1
    if not masked:
        return index, False
    return (tuple(out) if isinstance(index, tuple) or len(out) != 1 else out[0]), True


def admit(step: Step, args: tuple, kwargs: dict, where: str) -> None:
    """The allow-list's rules on a node's resolved arguments (types the graph cannot show before it meets a datum)."""
    if step.target in ("getitem", "operator.getitem") and any(
            isinstance(v, torch.Tensor) and v.dtype != torch.bool for v in flat(args[1:])):
        raise refuse(where, "indexing takes integers, slices, None, ..., index lists or a boolean mask, not index "
                            "tensors")
    if step.target == "to" and not all(isinstance(v, torch.dtype) for v in args[1:] + tuple(kwargs.values())):
        raise refuse(where, "to() takes only a dtype (tensors stay on the server's device)")
    if step.target == "torch.where" and len(args) + len(kwargs) == 1:
        raise refuse(where, "torch.where takes a condition and two values (one argument makes index tensors)")
    if step.target.startswith("operator.") and step.target != "operator.getitem" and not all(
            isinstance(v, (torch.Tensor, int, float)) for v in args):
        raise refuse(where, "operators take tensors and numbers (no sequence repetition or concatenation)")
    numbers = [v for v in args if isinstance(v, (int, float)) and not isinstance(v, bool)]
    if step.target in ("operator.pow", "torch.pow") and len(numbers) == 2 and isinstance(numbers[1], int) \
            and abs(numbers[1]) > 64:
        raise refuse(where, "integer powers of numbers take an exponent of at most 64")
    if step.target.startswith("math.") and any(isinstance(v, torch.Tensor) for v in args):
        raise refuse(where, "math functions take numbers (shapes, constants), not tensors")


# ---- a request's budget, and one datum's run -------------------------------------------------------------

def check_budget(program: Program, datums: list[tuple], logprobs: int) -> list[int]:
    """Plan every datum (each its inputs' (shape, dtype)) and add up their cost (and PLAN_WORK per node for each
    shape the request brings), refusing at the first datum that takes the request over `budget(logprobs)`:
    InvalidInput naming the datum, the work and the budget. A datum whose plan fails is InvalidInput naming the
    datum and the node. Returns each datum's cost (its plan's; planning is the request's, on the request thread)."""
    limit, spent, shapes, costs = budget(logprobs), 0, set(), []
    for b, inputs in enumerate(datums):
        if inputs not in shapes:
            shapes.add(inputs)
            spent += PLAN_WORK * len(program.steps)
        try:
            costs.append(plan_for(program, inputs).cost)
        except InvalidInput as e:
            raise InvalidInput(f"datum {b}: {e.message}", field=e.field, datum_index=b) from None
        spent += costs[-1]
        if spent > limit:
            raise InvalidInput(
                f"datum {b}: custom loss {program.name!r} would touch {spent} elements by this datum, over the "
                f"request's work budget of {limit} ({WORK_BASE} + {WORK_PER_LOGPROB} x its {logprobs} log-probs; "
                f"each node costs {NODE_WORK} per datum and {PLAN_WORK} per datum shape, + the elements it reads "
                "and makes, expanded views counted in full)", field="loss_config.graph", datum_index=b)
    return costs


def positions_worth(work: int) -> int:
    """Graph work as positions' worth of engine work (rounded up), for sharing the engine among runs."""
    return -(-work // WORK_PER_POSITION)


def run_program(program: Program, values: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum: the graph on its inputs (in `program.inputs` order) -> (scalar loss, metrics), as planned.

    A failing node is InvalidInput naming it; so is, after a boolean mask, a node whose real shapes would make
    more than its plan."""
    plan = plan_for(program, signature(values))
    env: dict[str, Any] = {name: v for (name, _), v in zip(program.inputs, values)}
    device, work = values[0].device, 0
    for step, planned in zip(program.steps, plan.made):
        where = f"node {step.index} ({step.name!r}, {step.target})"
        args, kwargs = resolve(step.args, env), {k: resolve(v, env) for k, v in step.kwargs.items()}
        if plan.masked:  # the real shapes, node by node, within the plan's sizes and work
            shadow = _meta((args, kwargs))
            n = _made(plan_node(step, *shadow, where)[0], plan.cap, where)
            work += node_work(step, *shadow, n)
            if n > planned or work > plan.work:
                raise refuse(where, f"on this datum's values it would make {n} elements (planned {planned}) and "
                                    f"touch {work} in all (planned {plan.work})")
        if step.rule == "size":
            kwargs["device"] = device  # made on the datum's device (no argument names one)
        try:
            out = step.fn(*args, **kwargs)
        except _FAILURES as e:
            raise refuse(where, f"failed: {str(e).splitlines()[0][:300] if str(e) else type(e).__name__}") from None
        if sum(int(t.numel()) for t in flat((out,)) if isinstance(t, torch.Tensor)) > planned:  # a guard
            raise refuse(where, f"made more than the {planned} elements planned from the datum's shapes")
        env[step.name] = out
    where = f"node {program.output[0]} ({program.output[1]!r}, output)"
    loss = resolve(program.loss, env)
    metrics = {}
    for key, ref in program.metrics.items():
        v = resolve(ref, env)
        metrics[key] = v.detach().reshape(()) if isinstance(v, torch.Tensor) else torch.tensor(float(v),
                                                                                               device=loss.device)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:  # the plan checked it; a guard
        raise refuse(where, "the loss must be a scalar floating-point tensor")
    return loss, metrics


def _meta(value: Any) -> Any:
    """`value` with every tensor replaced by a meta tensor of its shape and dtype."""
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, list):
        return [_meta(v) for v in value]
    if isinstance(value, tuple) and not isinstance(value, torch.Size):
        return tuple(_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _meta(v) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(_meta(value.start), _meta(value.stop), _meta(value.step))
    return value
