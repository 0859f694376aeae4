"""Server-side custom losses: a per-datum loss traced with torch.fx on the client, sent as plain data
(the Tinker SDK's `CustomLossGraph`), rebuilt here only from the allow-lists below, and run inside the
batched step as the `custom` entry of the loss table.

The definition is plain data, `{"name", "inputs": [{"name", "rank"}], "graph": {"format": 1, "nodes"}}`,
and `compile_loss` turns it into a `Program` or refuses it (InvalidInput naming the node: its index,
name and target). Nothing from the client is ever executed as Python: a call target is only a key into
`FUNCTIONS`, a method name only a member of `METHODS`, an attribute only one of `ATTRIBUTES`; constants
are numbers, booleans, None, short strings, slices and dtypes. Before a graph touches a datum it is
planned from the datum's shapes alone (custom_run.py): every node sized from all its arguments, and its
work counted against the request's work budget. The graph runs on detached copies of each datum's
log-probs, so it never holds the model's tensors; its gradient reaches the model through the log-probs
(chain rule, exact).

Per datum b the graph gives (L_b, metrics_b); the loss is sum_b L_b. Metrics keyed `custom/<name>:sum`
add over datums, `custom/<name>:mean` are their mean over datums (as the SDK's client-side path reduces).
Shapes: N positions of a datum, K candidates (rank 2), B datums.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from whitney.errors import InvalidInput
from whitney.protocol.training import METRIC_REDUCTIONS

MAX_NODES = 256
MAX_INPUTS = 16  # logprobs included (the SDK's bound)
MAX_VALUES = 64  # constants and refs in one node's args and kwargs, nested included
MAX_DEPTH = 4  # nesting of lists, tuples, dicts and slices in one argument
MAX_DEFINITION_BYTES = 256 * 1024
MAX_STRING = 64
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(" + "|".join(METRIC_REDUCTIONS) + ")")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
          "bfloat16": torch.bfloat16, "int64": torch.int64, "int32": torch.int32, "bool": torch.bool}

# Each op's rule, in words (custom_run.py sizes every node from its arguments as torch reads them): "same"
# (elementwise, reductions, views, indexing), "broadcast" (the broadcast of its tensor arguments), "size" (a
# size given in its arguments: zeros, ones, full, arange, tensor; made on the datum's device), "concat",
# "expand", "repeat".
_UNARY = ("exp", "log", "log1p", "expm1", "log2", "exp2", "abs", "neg", "sqrt", "rsqrt", "square", "sign",
          "sigmoid", "tanh", "relu", "floor", "ceil", "round", "trunc", "reciprocal", "isfinite", "isnan",
          "isinf", "logical_not", "nan_to_num", "sum", "mean", "prod", "amax", "amin", "argmax", "argmin",
          "logsumexp", "softmax", "log_softmax", "cumsum", "cumprod", "std", "var", "norm", "squeeze",
          "unsqueeze", "flatten", "reshape", "transpose", "zeros_like", "ones_like", "full_like", "clamp",
          "clip", "clamp_min", "clamp_max", "max", "min")  # no gather: an index out of range on a GPU is fatal
_BINARY = ("add", "sub", "mul", "div", "true_divide", "pow", "minimum", "maximum", "fmin", "fmax", "where",
           "eq", "ne", "lt", "le", "gt", "ge", "logical_and", "logical_or", "logical_xor", "lerp", "xlogy",
           "masked_fill", "remainder", "fmod")
_SIZED = ("zeros", "ones", "full", "arange", "tensor")
_CONCAT = ("cat", "stack")

FUNCTIONS: dict[str, tuple[Callable, str]] = {
    **{f"torch.{n}": (getattr(torch, n), "same") for n in _UNARY},
    **{f"torch.{n}": (getattr(torch, n), "broadcast") for n in _BINARY if n != "masked_fill"},
    **{f"torch.{n}": (getattr(torch, n), "size") for n in _SIZED},
    **{f"torch.{n}": (getattr(torch, n), "concat") for n in _CONCAT},
    "torch.broadcast_to": (torch.broadcast_to, "expand"),
    # torch.nn.functional, by the names fx records for them (a C function's module, or the Python one)
    "torch._C._nn.softplus": (F.softplus, "same"), "torch.nn.functional.softplus": (F.softplus, "same"),
    "torch._C._nn.log_sigmoid": (F.logsigmoid, "same"), "torch.nn.functional.logsigmoid": (F.logsigmoid, "same"),
    "torch.nn.functional.log_softmax": (F.log_softmax, "same"), "torch.nn.functional.softmax": (F.softmax, "same"),
    "torch.nn.functional.relu": (F.relu, "same"), "torch.nn.functional.silu": (F.silu, "same"),
    "torch._C._special.special_expit": (torch.special.expit, "same"),
    "torch.special.expit": (torch.special.expit, "same"),
    # Python operators (fx records arithmetic, comparison and indexing as these)
    **{f"operator.{n}": (getattr(operator, n), "broadcast") for n in (
        "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "eq", "ne", "lt", "le", "gt", "ge",
        "and_", "or_", "xor")},
    **{f"operator.{n}": (getattr(operator, n), "same") for n in ("neg", "pos", "abs", "invert", "getitem")},
    # math on Python numbers (shapes, constants)
    **{f"math.{n}": (getattr(math, n), "same") for n in ("exp", "log", "sqrt", "log1p", "expm1", "floor", "ceil")},
    "getattr": (getattr, "same"),  # of ATTRIBUTES only
}
METHODS: dict[str, str] = {
    **{n: "same" for n in _UNARY if n not in ("zeros_like", "ones_like", "full_like")},
    **{n: "broadcast" for n in _BINARY if n not in ("where", "xlogy")},
    "view": "same", "detach": "same", "float": "same", "double": "same", "long": "same", "bool": "same",
    "to": "same", "type_as": "same", "t": "same", "contiguous": "same", "clone": "same", "size": "same",
    "dim": "same", "numel": "same", "expand": "expand", "expand_as": "expand",
    "repeat": "repeat",
}
ATTRIBUTES = frozenset({"shape", "ndim", "dtype", "T"})
_KWARGS = frozenset({"dim", "keepdim", "min", "max", "dtype", "alpha", "value", "fill_value", "start", "end",
                     "step", "mask", "condition", "input", "other", "exponent", "weight", "unbiased",
                     "correction", "p", "nan", "posinf", "neginf", "rounding_mode", "beta", "threshold"})


@dataclass(frozen=True)
class Ref:
    name: str


@dataclass(frozen=True)
class Step:
    index: int  # the node's position in the graph
    name: str
    target: str
    fn: Callable  # from FUNCTIONS, or a bound-method caller for METHODS
    rule: str  # the op's rule (above); "size": made on the datum's device
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class Program:
    """A checked custom loss: its inputs (name, rank; logprobs first) and the steps that compute it."""

    name: str
    inputs: tuple[tuple[str, int], ...]
    steps: tuple[Step, ...]
    loss: Any  # a Ref or a constant
    metrics: dict[str, Any]
    output: tuple[int, str]  # the output node's index and name
    # The plans of the datum shapes this program has met (custom_run.plan_for), by (shape, dtype) of each input.
    plans: dict = field(default_factory=dict, compare=False, repr=False)


def refuse(where: str, rule: str) -> InvalidInput:
    return InvalidInput(f"custom loss: {where}: {rule}", field="loss_config.graph")


def _where(i: int, node: dict) -> str:
    """How an error names a node: its index, name, op and target (as sent, cut short)."""
    return f"node {i} ({repr(node.get('name'))[:80]}, {repr(node.get('op'))[1:-1][:20]} {repr(node.get('target'))[:140]})"


# Programs compiled lately, by the digest of their definition: a stored loss sent again (every training step,
# and the engine's check after the service's) is the same Program, with the plans it has made (custom_run.py).
COMPILED: OrderedDict[str, Program] = OrderedDict()
MAX_COMPILED = 16
_compiled_lock = threading.Lock()


def compile_loss(definition: Any) -> Program:
    """Check a custom loss definition against the allow-lists; any breach is InvalidInput naming the node."""
    if not isinstance(definition, dict) or set(definition) != {"name", "inputs", "graph"}:
        raise InvalidInput("a custom loss is {name, inputs, graph}, got "
                           f"{sorted(definition) if isinstance(definition, dict) else type(definition).__name__}",
                           field="loss_config")
    try:
        text = json.dumps(definition, sort_keys=True)
    except (TypeError, ValueError):
        raise InvalidInput("a custom loss must be plain JSON data", field="loss_config") from None
    if len(text) > MAX_DEFINITION_BYTES:
        raise InvalidInput(f"a custom loss definition is at most {MAX_DEFINITION_BYTES} bytes of JSON, got "
                           f"{len(text)}", field="loss_config")
    digest = hashlib.sha256(text.encode()).hexdigest()
    with _compiled_lock:
        if digest in COMPILED:
            COMPILED.move_to_end(digest)
            return COMPILED[digest]
    program = _compile(definition)
    with _compiled_lock:
        COMPILED[digest] = program
        while len(COMPILED) > MAX_COMPILED:
            COMPILED.popitem(last=False)
    return program


def _compile(definition: dict) -> Program:
    name = definition["name"]
    if not isinstance(name, str) or not 1 <= len(name) <= 128 or not name.isprintable():
        raise InvalidInput("custom loss name must be 1 to 128 printable characters", field="name")
    inputs = _inputs(definition["inputs"])
    graph = definition["graph"]
    if not isinstance(graph, dict) or set(graph) - {"format", "nodes"} or graph.get("format", 1) != 1:
        raise InvalidInput("graph must be {format: 1, nodes: [...]}", field="graph")
    nodes = graph.get("nodes")
    if not isinstance(nodes, list) or not nodes:
        raise InvalidInput("graph.nodes must be a non-empty list of nodes", field="graph.nodes")
    if len(nodes) > MAX_NODES:
        node = nodes[MAX_NODES] if isinstance(nodes[MAX_NODES], dict) else {}
        raise refuse(_where(MAX_NODES, node), f"a graph has at most {MAX_NODES} nodes, this one {len(nodes)}")
    seen: set[str] = set()
    steps: list[Step] = []
    placeholders: list[str] = []
    output = None
    for i, node in enumerate(nodes):
        if not isinstance(node, dict) or not {"op", "name", "target"} <= set(node) <= {"op", "name", "target",
                                                                                      "args", "kwargs"}:
            raise refuse(f"node {i}", "a node is {op, name, target, args, kwargs}")
        where = _where(i, node)
        op, target = node["op"], node["target"]
        if not isinstance(node["name"], str) or not NAME.fullmatch(node["name"]) or node["name"] in seen:
            raise refuse(where, "a node's name is a unique identifier of at most 64 characters")
        if not isinstance(target, str) or len(target) > 128:
            raise refuse(where, "a node's target is a name of at most 128 characters")
        if output is not None:
            raise refuse(where, "no node may follow the output node")
        args, kwargs = node.get("args", []), node.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise refuse(where, "args is a list and kwargs an object")
        count = [0]
        args = tuple(_decode(a, seen, where, count, 0) for a in args)
        for key in kwargs:
            if key not in _KWARGS:
                raise refuse(where, f"keyword {key!r} is not allowed; allowed: {sorted(_KWARGS)}")
        kwargs = {k: _decode(v, seen, where, count, 0) for k, v in kwargs.items()}
        if op == "placeholder":
            if steps or args or kwargs:
                raise refuse(where, "placeholders come first and take no arguments")
            placeholders.append(target)
        elif op == "call_function":
            if target not in FUNCTIONS:
                raise refuse(where, "this function is not in the allow-list of torch, math and operator functions")
            fn, rule = FUNCTIONS[target]
            if target == "getattr":
                if len(args) != 2 or kwargs or not isinstance(args[0], Ref) or args[1] not in ATTRIBUTES:
                    raise refuse(where, f"getattr reads only {sorted(ATTRIBUTES)} of a node")
            elif any(isinstance(v, str) for v in flat(args + tuple(kwargs.values()))) and target != "torch.div":
                raise refuse(where, "string arguments are allowed only for getattr and div's rounding_mode")
            steps.append(Step(i, node["name"], target, fn, rule, args, kwargs))
        elif op == "call_method":
            if target not in METHODS:
                raise refuse(where, "this tensor method is not in the allow-list")
            if not args or not isinstance(args[0], Ref):
                raise refuse(where, "a method is called on a node")
            if any(isinstance(v, str) for v in flat(args + tuple(kwargs.values()))) and target != "div":
                raise refuse(where, "string arguments are allowed only for getattr and div's rounding_mode")
            if target == "to" and not all(isinstance(v, (torch.dtype, Ref)) for v in args[1:] + tuple(kwargs.values())):
                raise refuse(where, "to() takes only a dtype (tensors stay on the server's device)")
            steps.append(Step(i, node["name"], target, _method(target), METHODS[target], args, kwargs))
        elif op == "output":
            output = (i, node["name"], args)
        else:  # get_attr (a captured tensor), call_module (torch.nn modules), anything else
            raise refuse(where, f"op {op!r} is not allowed; a custom loss is placeholders, call_function, "
                                 "call_method and one output")
        seen.add(node["name"])
    if placeholders != [n for n, _ in inputs]:
        raise InvalidInput(f"the graph's placeholders {placeholders} must be the declared inputs "
                           f"{[n for n, _ in inputs]}, in order", field="graph.nodes")
    if output is None:
        raise InvalidInput("the graph has no output node", field="graph.nodes")
    index, out_name, out_args = output
    value = out_args[0] if len(out_args) == 1 else None
    if not (isinstance(value, (tuple, list)) and len(value) == 2 and isinstance(value[1], dict)):
        raise refuse(f"node {index} ({out_name!r}, output)", "the output is (loss, {metric key: value})")
    for key in value[1]:
        if not METRIC_KEY.fullmatch(key):
            raise refuse(f"node {index} ({out_name!r}, output)", f"metric {key!r} must be named "
                          "custom/<name>:sum or custom/<name>:mean in lowercase")
    return Program(name, inputs, tuple(steps), value[0], dict(value[1]), (index, out_name))


def _inputs(raw: Any) -> tuple[tuple[str, int], ...]:
    if not isinstance(raw, list) or not 1 <= len(raw) <= MAX_INPUTS:
        raise InvalidInput(f"inputs must be a list of 1 to {MAX_INPUTS} inputs, logprobs first", field="inputs")
    out = []
    for i, x in enumerate(raw):
        if not isinstance(x, dict) or set(x) != {"name", "rank"}:
            raise InvalidInput(f"inputs[{i}] must be {{name, rank}}", field=f"inputs[{i}]")
        name, rank = x["name"], x["rank"]
        if not isinstance(name, str) or not INPUT_NAME.fullmatch(name) or name in (n for n, _ in out):
            raise InvalidInput(f"inputs[{i}].name must be a unique lowercase identifier, got {name!r}",
                               field=f"inputs[{i}].name")
        if rank not in (0, 1, 2) or isinstance(rank, bool):
            raise InvalidInput(f"inputs[{i}].rank must be 0, 1 or 2, got {rank!r}", field=f"inputs[{i}].rank")
        out.append((name, rank))
    if out[0][0] != "logprobs" or out[0][1] not in (1, 2):
        raise InvalidInput("inputs[0] must be logprobs with rank 1 ([N]) or 2 ([N, K])", field="inputs[0]")
    if any(n == "logprobs" for n, _ in out[1:]):
        raise InvalidInput("logprobs is the learner's; name the sampler's another way", field="inputs")
    return tuple(out)


def _decode(value: Any, seen: set[str], where: str, count: list[int], depth: int) -> Any:
    """One encoded argument as a value: a Ref, a constant or a container of them (the SDK's encoding)."""
    count[0] += 1
    if count[0] > MAX_VALUES or depth > MAX_DEPTH:
        raise refuse(where, f"arguments hold at most {MAX_VALUES} values, nested at most {MAX_DEPTH} deep")
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, int):
        if abs(value) > 2**53:
            raise refuse(where, f"integer constants are at most 2**53 in magnitude, got {value}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise refuse(where, "a non-finite float is sent as {\"float\": \"inf\"}")
        return value
    if isinstance(value, str):
        if len(value) > MAX_STRING:
            raise refuse(where, f"string constants are at most {MAX_STRING} characters")
        return value
    if isinstance(value, list):
        return [_decode(v, seen, where, count, depth + 1) for v in value]
    if not (isinstance(value, dict) and len(value) == 1):
        raise refuse(where, f"an argument of type {type(value).__name__} is not allowed")
    (kind, inner), = value.items()
    if kind == "ref":
        if inner not in seen:
            raise refuse(where, f"it refers to {inner!r}, which is no earlier node")
        return Ref(inner)
    if kind == "tuple" and isinstance(inner, list):
        return tuple(_decode(v, seen, where, count, depth + 1) for v in inner)
    if kind == "dict" and isinstance(inner, dict):
        return {str(k): _decode(v, seen, where, count, depth + 1) for k, v in inner.items()}
    if kind == "slice" and isinstance(inner, list) and len(inner) == 3:
        parts = [_decode(v, seen, where, count, depth + 1) for v in inner]
        if not all(p is None or isinstance(p, (int, Ref)) and not isinstance(p, bool) for p in parts):
            raise refuse(where, "a slice holds integers, None or nodes")
        return slice(*parts)
    if kind == "ellipsis" and inner is True:
        return Ellipsis
    if kind == "float" and inner in ("inf", "-inf", "nan"):
        return float(inner)
    if kind == "dtype" and inner in DTYPES:
        return DTYPES[inner]
    raise refuse(where, f"argument {{{kind!r}: ...}} is not allowed (devices, layouts and memory formats "
                         f"included: tensors stay where the server puts them); dtypes: {sorted(DTYPES)}")


def flat(values) -> list:
    out = []
    for v in values:
        if isinstance(v, (list, tuple)):
            out += flat(v)
        elif isinstance(v, dict):
            out += flat(tuple(v.values()))
        elif isinstance(v, slice):
            out += flat((v.start, v.stop, v.step))
        else:
            out.append(v)
    return out


def _method(name: str) -> Callable:
    """Calls the allowed tensor method `name` on its first argument (a tensor: checked in _call)."""
    def call(self, *args, **kwargs):
        if not isinstance(self, torch.Tensor):
            raise TypeError(f"{name}() is called on a tensor, got {type(self).__name__}")
        return getattr(self, name)(*args, **kwargs)
    return call


def resolve(value: Any, env: dict[str, Any]) -> Any:
    """An argument with its Refs replaced by the values `env` holds for them."""
    if isinstance(value, Ref):
        return env[value.name]
    if isinstance(value, tuple):
        return tuple(resolve(v, env) for v in value)
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, env) for k, v in value.items()}
    if isinstance(value, slice):
        return slice(resolve(value.start, env), resolve(value.stop, env), resolve(value.step, env))
    return value
