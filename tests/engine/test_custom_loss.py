"""Server-side custom losses (engine/custom_loss.py and the `custom` entry of the loss table).

Losses are traced by the real Tinker SDK (`trace_loss`, `encode_graph`: what `create_custom_loss` uploads).
Function level: value, metrics and gradient with respect to the learner log-probs equal a float64
reference (the same Python function on float64 copies, per datum, summed) and the SDK's own client-side
evaluation (`run_loss_handle`, what forward_backward_custom runs with a handle that stays local).
Engine level: the gradient a custom loss accumulates on every LoRA weight equals the SDK's callable path
(forward, dL/dlogprob on the client, cross_entropy with weights = -dL/dlogprob); a custom request
co-batched with another run's ppo request gives what each gives alone.
Hostile graphs: a catalogue, each refused with InvalidInput naming the node, and the engine trains after.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.engine.test_losses import new_run_id, randomize_B
from whitney.engine import Datum, Engine, ForwardRequest, LoraConfig
from whitney.engine.losses import custom as custom_graph
from whitney.engine.losses import custom_run
from whitney.engine.losses.builtin import custom, loss_spec
from whitney.engine.losses.custom import MAX_NODES, compile_loss
from whitney.errors import InvalidInput
from whitney.protocol.training import Checked

# ---- losses a user would write (per datum; traced by the SDK) -------------------------------------


def clipped_is(logprobs, old_logprobs, advantages):
    ratio = torch.exp(logprobs - old_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/clipped:sum": (ratio != clipped).float().sum()}


def weighted_nll(logprobs, weights):
    loss = -(logprobs * weights).sum() / (weights.sum() + 1.0)
    return loss, {"custom/nll:sum": loss.detach()}


def gated(logprobs, advantages, scale):
    """where / clamp / exp / softplus / logsumexp, and a per-datum scalar input (rank 0)."""
    z = torch.where(advantages > 0, torch.exp(logprobs).clamp(max=0.9), -F.softplus(logprobs))
    loss = scale * (z * advantages).sum() + torch.logsumexp(logprobs, dim=0) + logprobs[1:].mean()
    return loss, {"custom/z:mean": z.mean()}


def soft_targets(logprobs, weights):
    """[N, K] log-probs of K candidates per position."""
    loss = -(torch.softmax(weights, dim=-1) * logprobs).sum()
    return loss, {}


CASES = {  # name: (fn, input ranks, per-datum input makers (rng, n) -> array)
    "clipped_is": (clipped_is, {"logprobs": 1, "old_logprobs": 1, "advantages": 1},
                   {"old_logprobs": lambda r, n: -r.uniform(0.5, 3, n), "advantages": lambda r, n: r.normal(0, 1, n)}),
    "weighted_nll": (weighted_nll, {"logprobs": 1, "weights": 1}, {"weights": lambda r, n: r.uniform(0, 2, n)}),
    "gated": (gated, {"logprobs": 1, "advantages": 1, "scale": 0},
              {"advantages": lambda r, n: r.normal(0, 1, n), "scale": lambda r, n: np.array(r.uniform(0.5, 2))}),
    "soft_targets": (soft_targets, {"logprobs": 2, "weights": 2}, {"weights": lambda r, n: r.normal(0, 1, (n, 3))}),
}


def definition(fn, ranks) -> dict:
    """What create_custom_loss uploads for fn, as JSON (the SDK's own tracing and encoding)."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    handle = trace_loss(fn, ranks, "session")
    return json.loads(json.dumps({"name": handle.name, "inputs": [i.model_dump() for i in handle.inputs],
                                  "graph": encode_graph(handle).model_dump()}))


def case_inputs(name: str, lengths: list[int], seed: int = 0) -> list[dict[str, np.ndarray]]:
    fn, ranks, makers = CASES[name]
    rng = np.random.default_rng(seed)
    return [{k: np.asarray(make(rng, n), dtype=np.float32) for k, make in makers.items()} for n in lengths]


def logprob_shape(name: str, n: int) -> tuple:
    return (n, 3) if CASES[name][1]["logprobs"] == 2 else (n,)


# ---- function level -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_value_metrics_and_gradient_match_float64_and_the_sdk(name):
    from tinker import types
    from tinker.lib.public_interfaces.custom_loss import run_loss_handle, trace_loss

    fn, ranks, _ = CASES[name]
    lengths = [5, 3, 7]
    items = case_inputs(name, lengths)
    rng = np.random.default_rng(1)
    lps = [-rng.uniform(0.05, 4.0, logprob_shape(name, n)) for n in lengths]
    spec, config = loss_spec("custom").configure(definition(fn, ranks))

    # Engine: the datums concatenated, as the batched step hands them over.
    lp = torch.tensor(np.concatenate(lps), dtype=torch.float32, requires_grad=True)
    inputs = {k: torch.tensor(np.concatenate([it[k] for it in items])) if ranks[k] else
              torch.tensor(np.stack([it[k] for it in items])) for k in items[0]}
    inputs["datum_index"] = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    out = custom(lp, inputs, config)
    (grad,) = torch.autograd.grad(out.loss, lp)

    # Float64 reference: the same function per datum on float64 copies, summed.
    ref_lps = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in lps]
    ref_total, ref_metrics = 0.0, {}
    for x, it in zip(ref_lps, items):
        loss_b, metrics_b = fn(x, *(torch.tensor(it[k], dtype=torch.float64) for k in list(ranks)[1:]))
        ref_total = ref_total + loss_b
        for key, v in metrics_b.items():
            ref_metrics[key] = ref_metrics.get(key, 0.0) + float(v.detach())
    ref_grad = torch.cat(torch.autograd.grad(ref_total, ref_lps))
    ref_metrics = {k: v / len(lengths) if k.endswith(":mean") else v for k, v in ref_metrics.items()}
    assert float(out.loss) == pytest.approx(float(ref_total), rel=1e-5, abs=1e-5)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-6)
    for key, v in ref_metrics.items():
        assert out.metrics[key] == pytest.approx(v, rel=1e-5, abs=1e-6), key
    assert out.metrics["loss:sum"] == pytest.approx(float(ref_total), rel=1e-5, abs=1e-5)
    assert out.mean_counts == {k: len(lengths) for k in ref_metrics if k.endswith(":mean")}
    # elementwise_loss: dL/dl_t * l_t, as the SDK's client-side path reports it.
    share = (ref_grad * torch.cat([x.detach() for x in ref_lps]))
    torch.testing.assert_close(out.elementwise.double(), share.sum(-1) if share.dim() == 2 else share,
                               rtol=1e-5, atol=1e-6)

    # The SDK's client-side evaluation of the same traced loss (float32).
    handle = trace_loss(fn, ranks, "session")
    data = [types.Datum(model_input=types.ModelInput.from_ints([1] * n),
                        loss_fn_inputs={"target_tokens": np.zeros(logprob_shape(name, n), dtype=np.int64),
                                        **{k: v for k, v in it.items()}}) for n, it in zip(lengths, items)]
    sdk_lps = [torch.tensor(x, dtype=torch.float32, requires_grad=True) for x in lps]
    sdk_loss, sdk_metrics = run_loss_handle(handle, data, sdk_lps)
    sdk_grad = torch.cat(torch.autograd.grad(sdk_loss, sdk_lps))
    assert float(out.loss) == pytest.approx(float(sdk_loss), rel=1e-5, abs=1e-5)
    torch.testing.assert_close(grad, sdk_grad, rtol=1e-5, atol=1e-6)
    assert {k: out.metrics[k] for k in sdk_metrics} == pytest.approx(sdk_metrics, rel=1e-5, abs=1e-6)


# ---- engine level ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny_llama) -> Engine:
    e = Engine()
    e.load_model(tiny_llama)
    return e


LORA = LoraConfig(rank=4, alpha=8.0, seed=3)
SEQS = [[5, 17, 300, 42, 9, 1000, 77, 4321], [8, 2000, 3, 11, 4], [12345, 6, 49151]]


def engine_data(name: str, seqs=SEQS) -> list[Datum]:
    items = case_inputs(name, [len(s) - 1 for s in seqs], seed=5)
    out = []
    for s, it in zip(seqs, items):
        n = len(s) - 1
        targets = np.array([[t, (t + 1) % 49152, (t + 7) % 49152] for t in s[1:]]) if logprob_shape(name, n) != (n,) \
            else np.array(s[1:])
        inputs = {"target_tokens": {"dtype": "int64", "shape": list(targets.shape), "values": targets.flatten().tolist()}}
        for k, v in it.items():
            inputs[k] = {"dtype": "float32", "shape": list(v.shape), "values": v.flatten().tolist()}
        out.append(Datum(s[:-1], inputs))
    return out


def two_runs(engine: Engine, tiny_llama: str):
    a, b = new_run_id("custom"), new_run_id("callable")
    for run_id in (a, b):
        randomize_B(engine.create_run(run_id, tiny_llama, LORA), seed=9)
    return a, b


@pytest.mark.parametrize("name", ["clipped_is", "gated", "soft_targets"])
def test_engine_gradient_equals_the_sdk_callable_path(engine, tiny_llama, name):
    fn, ranks, _ = CASES[name]
    server, client = two_runs(engine, tiny_llama)
    data = engine_data(name)
    got = engine.forward_backward(server, data, "custom", definition(fn, ranks))

    # The callable path: log-probs from a forward, the loss and dL/dl on the client, then cross_entropy
    # with weights -dL/dl, whose gradient is the loss's (SDK TrainingClient._compute_custom_loss).
    total, linear = 0.0, []
    lps = _full_logprobs(engine, client, data)
    for d, lp in zip(data, lps):
        x = lp.clone().requires_grad_(True)
        extra = [torch.tensor(d.loss_inputs[k]["values"], dtype=torch.float32).reshape(d.loss_inputs[k]["shape"])
                 for k in list(ranks)[1:]]
        loss_b, _ = fn(x, *extra)
        (g,) = torch.autograd.grad(loss_b, x)
        total += float(loss_b)
        linear.append(Datum(d.token_ids, {"target_tokens": d.loss_inputs["target_tokens"],
                                          "weights": {"dtype": "float32", "shape": list(g.shape),
                                                      "values": (-g).flatten().tolist()}}))
    engine.forward_backward(client, linear, "cross_entropy", {})
    assert got.loss == pytest.approx(total, rel=1e-5, abs=1e-5)
    ga, gb = engine.get_run(server).grads, engine.get_run(client).grads
    assert set(ga) == set(gb) and ga
    for k in ga:  # float32 rounding: the two paths order the unembedding's sums differently (a few ulp at 1)
        torch.testing.assert_close(ga[k], gb[k], rtol=1e-4, atol=1e-6, msg=k)


def _full_logprobs(engine: Engine, run_id: str, data: list[Datum]) -> list[torch.Tensor]:
    """Per datum, the target log-probs [N] or [N, K] (cross_entropy with one-hot weights per candidate)."""
    out = []
    for d in data:
        shape = d.loss_inputs["target_tokens"]["shape"]
        if len(shape) == 1:
            (o,) = engine.forward(run_id, [Datum(d.token_ids, {"target_tokens": d.loss_inputs["target_tokens"]})]).outputs
            out.append(torch.tensor(o.logprobs))
            continue
        cols = []
        for k in range(shape[1]):
            w = np.zeros(shape, dtype=np.float32)
            w[:, k] = 1.0
            (o,) = engine.forward(run_id, [Datum(d.token_ids, {
                "target_tokens": d.loss_inputs["target_tokens"],
                "weights": {"dtype": "float32", "shape": shape, "values": w.flatten().tolist()}})]).outputs
            cols.append(torch.tensor(o.logprobs))
        out.append(torch.stack(cols, dim=1))
    return out


def test_custom_request_co_batches_with_other_runs(engine, tiny_llama):
    fn, ranks, _ = CASES["clipped_is"]
    spec = definition(fn, ranks)
    a, b = two_runs(engine, tiny_llama)
    data = engine_data("clipped_is")
    ppo_data = [Datum(d.token_ids, {"target_tokens": d.loss_inputs["target_tokens"],
                                    "old_logprobs": d.loss_inputs["old_logprobs"],
                                    "advantages": d.loss_inputs["advantages"]}) for d in data]
    alone = [engine.forward(a, data, "custom", spec), engine.forward(b, ppo_data, "ppo", {})]
    together = engine.run_batch([ForwardRequest(a, data, "custom", spec), ForwardRequest(b, ppo_data, "ppo", {})],
                                backward=False)
    for x, y in zip(alone, together):
        assert y.loss == pytest.approx(x.loss, rel=1e-5, abs=1e-6)
        assert y.metrics == pytest.approx(x.metrics, rel=1e-5, abs=1e-6)
        for ox, oy in zip(x.outputs, y.outputs):
            assert oy.logprobs == pytest.approx(ox.logprobs, rel=1e-5, abs=1e-6)


def test_declared_ranks_and_inputs_are_checked(engine, tiny_llama):
    fn, ranks, _ = CASES["weighted_nll"]
    run = new_run_id()
    engine.create_run(run, tiny_llama, LORA)
    spec = definition(fn, ranks)
    good = engine_data("weighted_nll")
    missing = [Datum(good[0].token_ids, {"target_tokens": good[0].loss_inputs["target_tokens"]})]
    with pytest.raises(InvalidInput) as e:
        engine.forward(run, missing, "custom", spec)
    assert e.value.field == "weights" and "required" in e.value.message
    extra = [Datum(good[0].token_ids, {**good[0].loss_inputs, "advantages": good[0].loss_inputs["weights"]})]
    with pytest.raises(InvalidInput) as e:
        engine.forward(run, extra, "custom", spec)
    assert e.value.field == "advantages"
    soft = engine_data("soft_targets")  # [N, K] targets for a loss that declared logprobs [N]
    is_data = engine_data("clipped_is")
    with pytest.raises(InvalidInput) as e:
        engine.forward(run, [Datum(soft[0].token_ids, {**is_data[0].loss_inputs,
                                                       "target_tokens": soft[0].loss_inputs["target_tokens"]})],
                       "custom", definition(*CASES["clipped_is"][:2]))
    assert e.value.field == "target_tokens" and "rank 2" in e.value.message and "rank 1" in e.value.message


# ---- hostile graphs ---------------------------------------------------------------------------------


def R(name: str) -> dict:
    return {"ref": name}


def node(op: str, name: str, target: str, *args, **kwargs) -> dict:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": kwargs}


def fn_node(name, target, *args, **kwargs):
    return node("call_function", name, target, *args, **kwargs)


def method(name, target, *args, **kwargs):
    return node("call_method", name, target, *args, **kwargs)


def graph(*body: dict, loss: str = "loss") -> dict:
    """logprobs and weights in, the body, `loss = logprobs.sum()` and the output."""
    nodes = [node("placeholder", "logprobs", "logprobs"), node("placeholder", "weights", "weights"), *body,
             method("loss", "sum", R("logprobs")),
             node("output", "output", "output", {"tuple": [R(loss), {"dict": {}}]})]
    return {"name": "evil", "inputs": [{"name": "logprobs", "rank": 1}, {"name": "weights", "rank": 1}],
            "graph": {"format": 1, "nodes": nodes}}


def _deep(n: int):
    return [_deep(n - 1)] if n else 1


# Each refused naming the node 'bad' (or, for the output, 'output'). "create": by compile_loss alone;
# "run": when it meets a datum (planned from the datum's shapes, before the batch).
HOSTILE = {
    "eval": ("create", graph(fn_node("bad", "builtins.eval", "__import__('os')"))),
    "bare eval": ("create", graph(fn_node("bad", "eval", "1"))),
    "exec": ("create", graph(fn_node("bad", "exec", "import os"))),
    "import": ("create", graph(fn_node("bad", "builtins.__import__", "os"))),
    "importlib": ("create", graph(fn_node("bad", "importlib.import_module", "subprocess"))),
    "os.system": ("create", graph(fn_node("bad", "os.system", "touch /tmp/pwned"))),
    "open": ("create", graph(fn_node("bad", "open", "/etc/passwd"))),
    "subprocess": ("create", graph(fn_node("bad", "subprocess.Popen", ["sh"]))),
    "socket": ("create", graph(fn_node("bad", "socket.create_connection", {"tuple": ["example.com", 80]}))),
    "torch.load": ("create", graph(fn_node("bad", "torch.load", "/tmp/x.pt"))),
    "torch.save": ("create", graph(fn_node("bad", "torch.save", R("logprobs"), "/tmp/x.pt"))),
    "torch.from_file": ("create", graph(fn_node("bad", "torch.from_file", "/etc/passwd"))),
    "aten op": ("create", graph(fn_node("bad", "torch.ops.aten.exp.default", R("logprobs")))),
    "getattr dunder": ("create", graph(fn_node("bad", "getattr", R("logprobs"), "__class__"))),
    "getattr globals": ("create", graph(fn_node("bad", "getattr", R("logprobs"), "__globals__"))),
    "getattr on a string": ("create", graph(fn_node("bad", "getattr", "torch", "load"))),
    "reduce": ("create", graph(method("bad", "__reduce_ex__", R("logprobs"), 2))),
    "in-place": ("create", graph(method("bad", "exp_", R("weights")))),
    "backward": ("create", graph(method("bad", "backward", R("logprobs")))),
    "numpy": ("create", graph(method("bad", "numpy", R("logprobs")))),
    "to device": ("create", graph(method("bad", "to", R("logprobs"), "cuda:1"))),
    "device argument": ("create", graph(fn_node("bad", "torch.zeros", 3, device={"device": "cpu"}))),
    "out=": ("create", graph(fn_node("bad", "torch.exp", R("weights"), out=R("weights")))),
    "setitem": ("create", graph(fn_node("bad", "operator.setitem", R("weights"), 0, 1.0))),
    "get_attr": ("create", graph(node("get_attr", "bad", "_tensor_constant0"))),
    "call_module": ("create", graph(node("call_module", "bad", "linear", R("logprobs")))),
    "unknown encoding": ("create", graph(fn_node("bad", "torch.exp", {"pickle": "gASVAAAA"}))),
    "forward ref": ("create", graph(fn_node("bad", "torch.exp", R("loss")))),
    "nested bomb": ("create", graph(fn_node("bad", "torch.tensor", _deep(50)))),
    "string argument": ("create", graph(fn_node("bad", "torch.exp", R("logprobs"), "x"))),
    "gather": ("create", graph(fn_node("bad", "torch.gather", R("logprobs"), 0, R("weights")))),
    "to a tensor": ("run", graph(method("bad", "to", R("logprobs"), R("weights")))),
    "zeros 1e10": ("run", graph(fn_node("bad", "torch.zeros", 10**10))),
    "full huge": ("run", graph(fn_node("bad", "torch.full", {"tuple": [100000, 100000]}, 1.0))),
    "arange huge": ("run", graph(fn_node("bad", "torch.arange", 10**12))),
    "expand huge": ("run", graph(method("bad", "expand", R("logprobs"), 10**6, -1))),
    "repeat huge": ("run", graph(method("bad", "repeat", R("logprobs"), 10**7))),
    "integer power": ("run", graph(fn_node("bad", "operator.pow", 10, 10**6))),
    "index tensor": ("run", graph(fn_node("idx", "torch.zeros", 10**4, dtype={"dtype": "int64"}),
                                  fn_node("bad", "operator.getitem", R("logprobs"), R("idx")))),
    "list repetition": ("run", graph(fn_node("bad", "operator.mul", [0] * 60, 10**9))),
    "shape repetition": ("run", graph(fn_node("shape", "getattr", R("logprobs"), "shape"),
                                      fn_node("bad", "operator.mul", R("shape"), 10**9))),
    "complex": ("run", graph(fn_node("bad", "operator.pow", -8, 0.5))),
    "shape error": ("run", graph(fn_node("z", "torch.zeros", 3), fn_node("bad", "operator.add", R("logprobs"), R("z")))),
    # An index list out of range is a device fault on an accelerator: refused from the shapes, never run.
    "index list out of range": ("run", graph(fn_node("bad", "operator.getitem", R("logprobs"), [0, 10**6]))),
    "nested index list": ("run", graph(fn_node("bad", "operator.getitem", R("logprobs"), [[0], [0]]))),
    "value as a number": ("run", graph(method("total", "sum", R("logprobs")),
                                       fn_node("bad", "math.floor", R("total")))),
    "where as nonzero": ("run", graph(fn_node("mask", "operator.gt", R("weights"), 0),
                                      fn_node("bad", "torch.where", R("mask")))),
}


def test_a_graph_failing_only_on_real_values_fails_alone_in_its_batch(engine, tiny_llama):
    """The plan (a mask keeps every element) cannot see a shape that depends on values; the batch isolates it."""
    a, b = two_runs(engine, tiny_llama)
    data = engine_data("weighted_nll")
    value_shaped = graph(method("mean", "mean", R("logprobs")), fn_node("mask", "operator.le", R("logprobs"), R("mean")),
                         fn_node("picked", "operator.getitem", R("logprobs"), R("mask")),
                         fn_node("bad", "operator.add", R("picked"), R("weights")))
    ce = [Datum(d.token_ids, {"target_tokens": d.loss_inputs["target_tokens"]}) for d in data]
    engine.validate(ForwardRequest(a, data, "custom", value_shaped), backward=True)  # the plan passes it
    alone = engine.forward(b, ce)
    engine.get_run(b).grads.clear()
    failed, ok = engine.run_batch([ForwardRequest(a, data, "custom", value_shaped), ForwardRequest(b, ce)],
                                  backward=True)
    assert isinstance(failed, InvalidInput) and "'bad'" in failed.message and failed.datum_index == 0
    assert "failed" in failed.message  # at run time, on the real shapes, not by the plan
    assert ok.loss == pytest.approx(alone.loss, rel=1e-5)
    assert not engine.get_run(a).grads and engine.get_run(b).grads


def test_non_scalar_output_and_bad_metric_names_are_refused(engine, tiny_llama):
    run = new_run_id()
    engine.create_run(run, tiny_llama, LORA)
    data = engine_data("weighted_nll")
    vector = graph(fn_node("twice", "operator.mul", R("logprobs"), 2), loss="twice")
    with pytest.raises(InvalidInput) as e:
        engine.forward(run, data, "custom", vector)
    assert "'output'" in e.value.message and "scalar" in e.value.message
    shadow = graph()
    shadow["graph"]["nodes"][-1]["args"] = [{"tuple": [R("loss"), {"dict": {"loss:sum": R("loss")}}]}]
    with pytest.raises(InvalidInput) as e:
        compile_loss(shadow)
    assert "'output'" in e.value.message and "loss:sum" in e.value.message


def test_too_many_nodes_is_refused_naming_the_first_over_the_limit():
    body = [fn_node(f"n{i}", "torch.exp", R("logprobs")) for i in range(MAX_NODES)]
    with pytest.raises(InvalidInput) as e:
        compile_loss(graph(*body))
    assert f"node {MAX_NODES}" in e.value.message and f"at most {MAX_NODES}" in e.value.message


def test_hostile_graphs_are_refused_naming_the_node_and_the_engine_trains_after(engine, tiny_llama):
    assert len(HOSTILE) >= 20
    run = new_run_id()
    engine.create_run(run, tiny_llama, LORA)
    data = engine_data("weighted_nll")
    for label, (stage, spec) in HOSTILE.items():
        if stage == "create":
            with pytest.raises(InvalidInput) as e:
                compile_loss(spec)
        else:
            compile_loss(spec)  # well-formed: refused when it meets a datum
            with pytest.raises(InvalidInput) as e:
                engine.forward_backward(run, data, "custom", spec)
        assert "'bad'" in e.value.message, (label, e.value.message)
    assert not engine.get_run(run).grads  # nothing refused left a gradient
    # Unharmed: a real custom loss still trains.
    fn, ranks, _ = CASES["weighted_nll"]
    before = engine.forward(run, data, "custom", definition(fn, ranks)).loss
    engine.forward_backward(run, data, "custom", definition(fn, ranks))
    engine.optim_step(run, {"learning_rate": 0.05})
    after = engine.forward(run, data, "custom", definition(fn, ranks)).loss
    assert np.isfinite(after) and after < before


# ---- sizes from every argument, before anything is made (issue 31, item 4) ------------------------------


def one_token_data(n: int) -> list[Datum]:
    """n datums of one target token each (the issue's cheapest carrier of a graph)."""
    return [Datum([5 + i], {"target_tokens": {"dtype": "int64", "shape": [1], "values": [7 + i]},
                            "weights": {"dtype": "float32", "shape": [1], "values": [1.0]}}) for i in range(n)]


class RealCalls:
    """Wraps an allow-listed function and records each call that is not on meta tensors (the plan's), and the
    most elements such a call read (the plan reads an op's dtype off one-element stand-ins)."""

    def __init__(self, fn):
        self.fn, self.calls, self.largest = fn, 0, 0

    def __call__(self, *args, **kwargs):
        tensors = [v for v in custom_graph.flat(args + tuple(kwargs.values())) if isinstance(v, torch.Tensor)]
        if kwargs.get("device") != "meta" and not any(t.is_meta for t in tensors):
            self.calls += 1
            self.largest = max([self.largest] + [t.numel() for t in tensors])
        return self.fn(*args, **kwargs)


def spy(monkeypatch, target: str) -> RealCalls:
    custom_graph.COMPILED.clear()  # graphs compiled from now on call the spy
    fn, rule = custom_graph.FUNCTIONS[target]
    wrapped = RealCalls(fn)
    monkeypatch.setitem(custom_graph.FUNCTIONS, target, (wrapped, rule))
    return wrapped


# Each makes far more than the size bound (65536 elements for these datums) from an argument the old bound
# did not read: arange's keywords, an index list (positional or nested in a tuple) over a wide tensor.
OVERSIZED = {
    "arange by keywords": ("torch.arange", [fn_node("bad", "torch.arange", start=-2.5e6, end=0.0, step=1.0)]),
    "arange with a tiny step": ("torch.arange", [fn_node("bad", "torch.arange", 0, 1, step=4e-7)]),
    "arange end by keyword": ("torch.arange", [fn_node("bad", "torch.arange", 0, end=10**7)]),
    "index list": ("operator.getitem", [fn_node("wide", "torch.zeros", 1, 65536),
                                        fn_node("bad", "operator.getitem", R("wide"), [0] * 60)]),
    "nested index list in a tuple": ("operator.getitem", [
        fn_node("wide", "torch.zeros", 1, 65536),
        fn_node("bad", "operator.getitem", R("wide"), {"tuple": [[[0] * 6] * 6]})]),
}


@pytest.mark.parametrize("label", list(OVERSIZED))
def test_a_size_in_any_argument_is_refused_before_the_tensor_is_made(engine, tiny_llama, monkeypatch, label):
    target, body = OVERSIZED[label]
    calls = spy(monkeypatch, target)
    run = new_run_id()
    engine.create_run(run, tiny_llama, LORA)
    with pytest.raises(InvalidInput) as e:
        engine.forward_backward(run, engine_data("weighted_nll"), "custom", graph(*body))
    assert "'bad'" in e.value.message and "over the bound of 65536" in e.value.message, e.value.message
    assert e.value.field == "loss_config.graph" and e.value.datum_index == 0
    assert calls.calls == 0  # never run on real tensors: refused from the shapes alone
    assert not engine.get_run(run).grads


# ---- the work a graph does, budgeted per request (issue 31, item 3) ------------------------------------


def amplifier(repeats: int) -> dict:
    """The issue's graph: one element expanded to 65536, reduced again and again (each read costs 65536)."""
    body = [fn_node("first", "operator.getitem", R("logprobs"), {"slice": [0, 1, None]}),
            method("wide", "expand", R("first"), 65536)]
    body += [fn_node(f"lse{i}", "torch.logsumexp", R("wide"), 0) for i in range(repeats)]
    return graph(*body)


def test_work_counts_what_every_node_reads_and_makes_expanded_views_in_full():
    program = compile_loss(amplifier(1))
    plan = custom_run.plan_for(program, (((1,), torch.float32), ((1,), torch.float32)))
    W = custom_run.NODE_WORK
    # getitem reads 1, makes 1; expand reads 1, makes a 65536-element view; logsumexp reads all 65536 of it
    # and makes 1; the loss (logprobs.sum()) reads 1, makes 1.
    assert plan.work == (W + 2) + (W + 1 + 65536) + (W + 65536 + 1) + (W + 2)
    assert list(plan.made) == [1, 65536, 1, 1] and not plan.masked


def test_the_issues_amplifier_is_refused_before_any_of_it_runs(engine, tiny_llama, monkeypatch):
    calls = spy(monkeypatch, "torch.logsumexp")
    run = new_run_id()
    engine.create_run(run, tiny_llama, LORA)
    spec = amplifier(MAX_NODES - 6)  # 250 reductions of an expanded view, as in the issue
    for n in (1, 12):
        with pytest.raises(InvalidInput) as e:
            engine.validate(ForwardRequest(run, one_token_data(n), "custom", spec), backward=True)
        assert e.value.field == "loss_config.graph" and e.value.datum_index == 0
        assert "work budget" in e.value.message and f"{custom_run.budget(n)}" in e.value.message
    with pytest.raises(InvalidInput):
        engine.forward_backward(run, one_token_data(12), "custom", spec)
    assert calls.largest <= 1 and not engine.get_run(run).grads  # never over the 65536-element view


def test_the_work_budget_adds_up_over_a_requests_datums(engine, tiny_llama):
    """Each datum fits alone; the request is refused at the first datum that takes the sum over its budget."""
    run = new_run_id()
    engine.create_run(run, tiny_llama, LORA)
    spec = graph(*[fn_node(f"e{i}", "torch.exp", R("logprobs")) for i in range(20)])
    program = compile_loss(spec)
    cost = custom_run.plan_for(program, (((1,), torch.float32), ((1,), torch.float32))).cost
    assert cost > custom_run.WORK_PER_LOGPROB  # a one-token datum costs more than it brings
    planning = custom_run.PLAN_WORK * len(program.steps)  # once: every datum has the same shape
    fits = (custom_run.WORK_BASE - planning) // (cost - custom_run.WORK_PER_LOGPROB)  # <= budget(n)
    checked = engine.validate(ForwardRequest(run, one_token_data(fits), "custom", spec), backward=True)
    # Each datum: its one position, and its graph's work as positions' worth (the scheduler's share).
    assert checked == Checked([1] * fits, [1 + custom_run.positions_worth(cost)] * fits)
    over = fits + 1
    with pytest.raises(InvalidInput) as e:
        engine.validate(ForwardRequest(run, one_token_data(over), "custom", spec), backward=True)
    assert e.value.datum_index == (custom_run.budget(over) - planning) // cost  # the first datum past the budget
    assert f"work budget of {custom_run.budget(over)}" in e.value.message


def test_a_masked_graph_is_planned_at_its_worst_and_runs_on_the_real_shapes():
    def kept(logprobs, weights):
        picked = logprobs[weights > 0]
        return -picked.sum() + picked.numel(), {"custom/kept:sum": (weights > 0).float().sum()}

    spec, config = loss_spec("custom").configure(definition(kept, {"logprobs": 1, "weights": 1}))
    plan = custom_run.plan_for(config["program"], (((4,), torch.float32), ((4,), torch.float32)))
    assert plan.masked and plan.cost > plan.work
    lp = torch.tensor([-1.0, -2.0, -3.0, -4.0], requires_grad=True)
    weights = torch.tensor([1.0, 0.0, 2.0, 0.0])
    out = custom(lp, {"weights": weights, "datum_index": torch.zeros(4, dtype=torch.long)}, config)
    assert float(out.loss) == pytest.approx(4.0 + 2) and out.metrics["custom/kept:sum"] == 2
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad.tolist() == [-1.0, 0.0, -1.0, 0.0]
    # A size that shrinks as the mask grows would make more on the real values than planned: refused there.
    grows = graph(fn_node("mask", "operator.gt", R("weights"), 0), fn_node("kept", "operator.getitem", R("logprobs"),
                                                                            R("mask")),
                  method("count", "size", R("kept"), 0), fn_node("rest", "operator.sub", 64, R("count")),
                  fn_node("bad", "torch.zeros", R("rest")))
    _, config = loss_spec("custom").configure(grows)
    with pytest.raises(InvalidInput) as e:
        custom(lp.detach(), {"weights": weights, "datum_index": torch.zeros(4, dtype=torch.long)}, config)
    assert "'bad'" in e.value.message and "planned 60" in e.value.message and e.value.datum_index == 0


def _shapes_cases():
    g = torch.Generator().manual_seed(0)
    x31, x4, x23, x234 = (torch.randn(*s, generator=g) for s in ((3, 1), (4,), (2, 3), (2, 3, 4)))
    b31, b4, i3 = torch.rand(3, 1, generator=g) > 0.5, torch.rand(4, generator=g) > 0.5, torch.arange(1, 4)
    x43 = torch.randn(4, 3, generator=g)
    return [
        ("torch.exp", (x31,), {}), ("operator.add", (x31, x4), {}), ("torch.where", (b31, x4, 0.0), {}),
        ("torch.clamp", (x31,), {"min": x4}), ("operator.truediv", (i3, i3), {}), ("operator.lt", (x31, 0), {}),
        ("masked_fill", (x31, b4, 0.0), {}), ("torch.lerp", (x31, x4, 0.5), {}), ("cumsum", (x23, 1), {}),
        ("torch.cumsum", (b4, 0), {}), ("torch.softmax", (x23, -1), {}), ("to", (x23, torch.float64), {}),
        ("long", (x23,), {}), ("torch.nan_to_num", (i3,), {}), ("torch.logsumexp", (x23, 1), {"keepdim": True}),
        ("mean", (x234, (0, 2)), {}), ("mean", (x23,), {}), ("norm", (x23, 2, 1), {}), ("norm", (x23,), {}),
        ("std", (x23, 1), {"keepdim": True}), ("std", (x23, True), {}), ("var", (x23,), {"dim": 0, "correction": 0}),
        ("torch.cat", ([x23, x43[:2]],), {}), ("torch.cat", ([x23, x31[:2]],), {"dim": 1}),
        ("torch.stack", ([x23, x23], -1), {}), ("operator.getitem", (x43, [0, 3, 3, -1]), {}),
        ("operator.getitem", (x234, (Ellipsis, [1, 0])), {}), ("operator.getitem", (x43, (None, b4)), {}),
        ("torch.sum", (b4, 0), {}), ("torch.nn.functional.softplus", (x23,), {}), ("operator.pow", (x23, 2), {}),
        ("torch.pow", (2, x23), {}), ("torch.xlogy", (x31, x4), {}), ("operator.and_", (b31, b4), {}),
        ("operator.invert", (b4,), {}), ("max", (x23, 1), {}), ("torch.amax", (x234, (0, 1)), {}),
        ("expand", (x31, 2, 3, -1), {}), ("repeat", (x23, 2, 1, 3), {}), ("reshape", (x234, -1, 4), {}),
        ("torch.arange", (0, 1), {"step": 0.3}), ("torch.full", ((2, 3), 1), {}),
    ]


def test_the_plan_makes_the_shapes_and_dtypes_the_real_ops_make():
    """The plan's shape rules (broadcast, reductions sized like another, cat, stack, index lists) and its meta
    tensors agree with torch on real tensors; a boolean mask is planned at its worst (every element kept)."""
    for target, args, kwargs in _shapes_cases():
        fn, rule = (custom_graph.FUNCTIONS[target] if target in custom_graph.FUNCTIONS
                    else (custom_graph._method(target), custom_graph.METHODS[target]))
        step = custom_graph.Step(0, "n", target, fn, rule, args, kwargs)
        real = fn(*args, **kwargs)
        meta_args = custom_run._meta((args, {**kwargs, **({"device": "cpu"} if rule == "size" else {})}))
        planned, masked = custom_run.plan_node(step, *meta_args, "here")
        for p, r in zip(custom_graph.flat((planned,)), custom_graph.flat((real,))):
            assert isinstance(p, torch.Tensor) and p.is_meta, target
            if masked:  # the mask kept 2 of its 4 here; the plan keeps all 4
                assert p.shape[1] == 4 and r.shape[1] == int(args[1][1].sum()), target
            else:
                assert (p.shape, p.dtype) == (r.shape, r.dtype), (target, p.shape, r.shape, p.dtype, r.dtype)
