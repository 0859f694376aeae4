"""Many runs' optim_steps in one pass (`optim.optim_steps`, `InProcessBackend.optim_steps`) equal each run's
own step bitwise; one adapter's delta over a whole batch, added in place (`RowGroups.apply`), equals the
concatenated deltas of a batch of groups, values and gradients."""

from __future__ import annotations

import pytest
import torch

from whitney.backends.in_process import InProcessBackend
from whitney.engine import Datum, Engine, ForwardRequest, LoraConfig
from whitney.engine.families.lora import Adapter, RowGroups, lora_delta
from whitney.engine.training import optim
from whitney.engine.training.optim import OptimizerState, optim_step, optim_steps
from whitney.errors import InvalidInput
from whitney.protocol.backend import Failure
from whitney.protocol.training import AdamParams

# Each run its own shapes and hyperparameters: clipping on and off, weight decay, LoRA+, gradient_scale.
RUNS = [
    ({"m.0.lora_A": (4, 8), "m.0.lora_B": (6, 4)}, AdamParams(learning_rate=1e-2)),
    ({"m.0.lora_A": (2, 8), "m.0.lora_B": (6, 2), "m.1.lora_A": (2, 5), "m.1.lora_B": (3, 2)},
     AdamParams(learning_rate=3e-3, beta1=0.8, beta2=0.99, eps=1e-8, weight_decay=0.1, gradient_clip_norm=0.5)),
    ({"m.1.lora_A": (8, 5), "m.1.lora_B": (3, 8)},
     AdamParams(learning_rate=5e-4, lora_plus_ratio=16.0, gradient_scale=0.25, gradient_clip_norm=100.0)),
    ({"m.0.lora_A": (4, 8), "m.0.lora_B": (6, 4)}, AdamParams(learning_rate=2e-2, weight_decay=0.01)),
]


def _run(shapes: dict, seed: int) -> tuple[dict, OptimizerState]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in shapes.items()}, OptimizerState()


def _grads(shapes: dict, seed: int, step: int) -> dict:
    g = torch.Generator().manual_seed(1000 * seed + step)
    # The last run's B gets no gradient on even steps (a weight without one gets a zero gradient).
    return {n: torch.randn(s, generator=g) * (seed + 1) for n, s in shapes.items()
            if not (seed == len(RUNS) - 1 and n.endswith("lora_B") and step % 2 == 0)}


def _assert_same(one: tuple, other: tuple) -> None:
    (w1, s1), (w2, s2) = one, other
    assert s1.step == s2.step
    for n in w1:
        assert torch.equal(w1[n], w2[n]), n
        assert torch.equal(s1.exp_avg[n], s2.exp_avg[n]), n
        assert torch.equal(s1.exp_avg_sq[n], s2.exp_avg_sq[n]), n


@pytest.mark.parametrize("chunk", [optim.STEP_CHUNK_ELEMENTS, 100], ids=["one-pass", "chunks-of-runs"])
def test_optim_steps_equal_each_runs_own_step_bitwise(monkeypatch, chunk):
    monkeypatch.setattr(optim, "STEP_CHUNK_ELEMENTS", chunk)
    alone = [_run(shapes, i) for i, (shapes, _) in enumerate(RUNS)]
    batched = [_run(shapes, i) for i, (shapes, _) in enumerate(RUNS)]
    for step in range(3):
        want = []
        for i, ((shapes, hp), (weights, state)) in enumerate(zip(RUNS, alone)):
            grads = _grads(shapes, i, step)
            want.append(optim_step(weights, grads, state, hp))
        all_grads = [_grads(shapes, i, step) for i, (shapes, _) in enumerate(RUNS)]
        got = optim_steps([(weights, grads, state, hp) for (weights, state), grads, (_, hp)
                           in zip(batched, all_grads, RUNS)])
        assert got == want  # grad_norm, step, learning rates: each run's own
        assert all(grads == {} for grads in all_grads)  # consumed
        for a, b in zip(alone, batched):
            _assert_same(a, b)
    assert want[1]["grad_norm"] > RUNS[1][1].gradient_clip_norm  # the clip is exercised
    assert want[2]["grad_norm"] < RUNS[2][1].gradient_clip_norm  # and left alone below its threshold


def _engine(tiny_llama: str) -> tuple[Engine, list[str]]:
    engine = Engine()
    runs = []
    for i, lora in enumerate([LoraConfig(rank=2, seed=1), LoraConfig(rank=4, seed=2, train_mlp=False),
                              LoraConfig(rank=3, seed=3)]):
        engine.create_run(f"r{i}", tiny_llama, lora)
        runs.append(f"r{i}")
    g = torch.Generator().manual_seed(7)
    for step in range(2):
        data = {r: [Datum(torch.randint(0, 500, (n,), generator=g).tolist(),
                          {"target_tokens": torch.randint(0, 500, (n,), generator=g).tolist()})
                    for n in (5, 9)] for r in runs}
        engine.run_batch([ForwardRequest(r, data[r]) for r in runs], backward=True)
        yield engine, runs


def test_backend_optim_steps_equal_per_run_steps_and_fail_alone(tiny_llama):
    params = [AdamParams(learning_rate=1e-2), AdamParams(learning_rate=1e-3, gradient_clip_norm=0.01),
              AdamParams(learning_rate=5e-3, lora_plus_ratio=4.0, weight_decay=0.1)]
    for (one, runs), (other, _) in zip(_engine(tiny_llama), _engine(tiny_llama)):
        want = [one.optim_step(r, p) for r, p in zip(runs, params)]
        got = InProcessBackend(other).optim_steps(list(zip(runs, params)))
        assert got == want
        for r in runs:
            for (name, a), (_, b) in zip(one.runs[r].adapter.named_parameters(),
                                         other.runs[r].adapter.named_parameters()):
                assert torch.equal(a, b), (r, name)
            assert other.runs[r].grads == {}
    # A refused step fails alone: an unknown run, bad parameters, a run twice in one call.
    backend = InProcessBackend(other)
    before = {n: t.clone() for n, t in other.runs["r0"].adapter.named_parameters()}
    out = backend.optim_steps([("nope", AdamParams()), ("r1", AdamParams(learning_rate=-1.0)), ("r0", AdamParams()),
                               ("r0", AdamParams())])
    assert isinstance(out[0], Failure) and out[0].code == "not_found" and out[0].field == "run_id"
    assert isinstance(out[1], Failure) and out[1].field == "learning_rate" and out[1].category == "user"
    assert out[2]["step"] == 3.0
    assert isinstance(out[3], Failure) and out[3].code == "conflict"
    assert any(not torch.equal(t, before[n]) for n, t in other.runs["r0"].adapter.named_parameters())


def _snapshot(weights: dict, state: OptimizerState) -> tuple:
    return ({n: t.clone() for n, t in weights.items()}, state.step,
            {n: t.clone() for n, t in state.exp_avg.items()}, {n: t.clone() for n, t in state.exp_avg_sq.items()})


def _assert_unchanged(before: tuple, weights: dict, state: OptimizerState) -> None:
    w, step, m, v = before
    assert state.step == step and sorted(state.exp_avg) == sorted(m) and sorted(state.exp_avg_sq) == sorted(v)
    for n in w:
        assert torch.equal(weights[n], w[n]), n
    for n in m:
        assert torch.equal(state.exp_avg[n], m[n]) and torch.equal(state.exp_avg_sq[n], v[n]), n


@pytest.mark.parametrize("chunk", [optim.STEP_CHUNK_ELEMENTS, 100], ids=["one-pass", "chunks-of-runs"])
def test_a_non_finite_gradient_is_refused_alone_and_dropped(monkeypatch, chunk):
    """Among batched steps, a run whose gradient holds a NaN, one whose gradient_scale overflows it to infinity,
    and one refused on its very first step take no step: weights, moments and step count bitwise as they were
    (no zero moments made), the gradient dropped, the result a NonFiniteGradient naming the modules; every
    other run steps bitwise as alone. The refused runs step normally next time."""
    monkeypatch.setattr(optim, "STEP_CHUNK_ELEMENTS", chunk)
    alone = [_run(shapes, i) for i, (shapes, _) in enumerate(RUNS)]
    batched = [_run(shapes, i) for i, (shapes, _) in enumerate(RUNS)]
    hps = [hp for _, hp in RUNS]
    for i, (shapes, hp) in enumerate(RUNS):  # a first step for all but run 3 (whose first one is refused)
        if i != 3:
            for weights, state in (alone[i], batched[i]):
                optim_step(weights, _grads(shapes, i, 0), state, hp)
    all_grads = [_grads(shapes, i, 1) for i, (shapes, _) in enumerate(RUNS)]
    all_grads[0]["m.0.lora_B"][1, 2] = float("nan")
    hps[2] = AdamParams(learning_rate=5e-4, gradient_scale=1e38)  # finite gradients times 1e38: infinities
    all_grads[3]["m.0.lora_A"][0, 0] = float("-inf")
    before = [_snapshot(weights, state) for weights, state in batched]
    got = optim_steps([(weights, grads, state, hp) for (weights, state), grads, hp in zip(batched, all_grads, hps)])
    assert all(grads == {} for grads in all_grads), "every gradient consumed or dropped"
    for i in (0, 2, 3):
        assert isinstance(got[i], optim.NonFiniteGradient) and got[i].code == "invalid_input", got[i]
        _assert_unchanged(before[i], *batched[i])
    assert got[0].weights == ["m.0.lora_B"] and "1 module: m.0;" in got[0].message
    assert "not finite" in got[0].message and "refused" in got[0].message
    assert got[3].weights == ["m.0.lora_A"] and batched[3][1].exp_avg == {}, "no moments made by a refused step"
    assert "2 modules: m.1" in got[2].message or "1 module: m.1" in got[2].message, got[2].message
    assert "of run 'r'" in got[0].of_run("r").message
    want = optim_step(alone[1][0], _grads(RUNS[1][0], 1, 1), alone[1][1], RUNS[1][1])
    assert got[1] == want
    _assert_same(alone[1], batched[1])
    with pytest.raises(optim.NonFiniteGradient):  # one run alone raises it
        optim_step(batched[0][0], {"m.0.lora_A": torch.full((4, 8), float("nan"))}, batched[0][1], hps[0])
    _assert_unchanged(before[0], *batched[0])
    # Next time, finite gradients: the refused runs step as runs that never saw the bad gradient.
    for i in (0, 3):
        shapes, hp = RUNS[i]
        want = optim_step(alone[i][0], _grads(shapes, i, 2), alone[i][1], hp)
        assert optim_step(batched[i][0], _grads(shapes, i, 2), batched[i][1], hp) == want
        _assert_same(alone[i], batched[i])


def _nan_loss(logprobs):
    """log-probs are negative: their square root is NaN, and so is its gradient (a real custom loss's mistake)."""
    loss = torch.sqrt(logprobs).sum()
    return loss, {}


def test_a_nan_loss_gradient_is_refused_by_the_engine_and_the_run_trains_on(tiny_llama):
    """End to end in the engine: a custom loss whose gradient is NaN, then batched optim_steps with another
    run: the NaN run's step fails alone (invalid_input naming the run and its modules), its adapter and AdamW
    state bitwise unchanged and its gradient dropped; the other run steps as it would alone; the NaN run then
    trains on with finite numbers."""
    from tests.engine.test_custom_loss import definition

    spec = definition(_nan_loss, {"logprobs": 1})
    data = [Datum([5, 17, 42, 8, 99], {"target_tokens": [17, 42, 8, 99, 3]})]
    one, ref = Engine(), Engine()
    for engine in (one, ref):
        for run_id in ("nan", "ok"):
            engine.create_run(run_id, tiny_llama, LoraConfig(rank=2, seed=1))
            engine.forward_backward(run_id, data)
            engine.optim_step(run_id, AdamParams(learning_rate=1e-2))
        engine.forward_backward("ok", data)
    run = one.runs["nan"]
    result = one.forward_backward("nan", data, "custom", spec)
    assert result.loss != result.loss, "the loss is NaN"
    assert run.grads and not all(torch.isfinite(g).all() for g in run.grads.values())
    before = _snapshot(run.weights(), run.optimizer)
    params = AdamParams(learning_rate=1e-2)
    failure, metrics = InProcessBackend(one).optim_steps([("nan", params), ("ok", params)])
    assert isinstance(failure, Failure) and failure.code == "invalid_input" and failure.category == "user", failure
    assert "run 'nan'" in failure.message and "not finite" in failure.message and "model.layers.0" in failure.message
    _assert_unchanged(before, run.weights(), run.optimizer)
    assert run.grads == {}, "dropped"
    assert metrics == ref.optim_step("ok", params)
    with pytest.raises(InvalidInput) as e:  # one run alone, the same refusal
        one.forward_backward("nan", data, "custom", spec)
        one.optim_step("nan", params)
    assert "run 'nan'" in e.value.message
    _assert_unchanged(before, run.weights(), run.optimizer)
    # The run trains on: the same numbers as the reference run that never saw the NaN loss.
    for engine in (one, ref):
        engine.forward_backward("nan", data)
    got, want = one.optim_step("nan", params), ref.optim_step("nan", params)
    assert got == want and got["grad_norm"] > 0


def _adapter(rank: int, d_in: int, d_out: int, seed: int) -> Adapter:
    g = torch.Generator().manual_seed(seed)
    A = {"p": torch.randn(rank, d_in, generator=g).requires_grad_(True)}
    B = {"p": torch.randn(d_out, rank, generator=g).requires_grad_(True)}
    return Adapter(LoraConfig(rank=rank, alpha=2.0 * rank), A, B)


@pytest.mark.parametrize("rows,rank,d_in,d_out", [(3, 8, 64, 49152), (256, 8, 64, 4096), (40, 32, 96, 64), (1, 4, 16, 64)])
def test_one_group_in_place_equals_the_concatenated_deltas(rows, rank, d_in, d_out):
    """One adapter over all rows (its delta added in place) against the same rows in a two-group batch (the
    deltas concatenated, then added): the outputs, and the gradients of A, B and x, are bitwise equal."""
    adapter = _adapter(rank, d_in, d_out, seed=rows)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, d_in, generator=g, requires_grad=True)
    w = torch.randn(d_out, d_in, generator=g)
    grad = torch.randn(rows, d_out, generator=g)

    # The base projection's output, the same rows either way (no gradient: only the delta's is compared).
    pad = torch.randn(5, d_in, generator=g)
    xx = torch.cat([x, pad])
    y = (xx @ w.T).detach()

    fused = RowGroups([(0, rows, adapter)]).apply("p", x, y[:rows].clone())
    assert torch.equal(fused, y[:rows] + lora_delta(adapter, "p", x))
    want = torch.autograd.grad(fused, [adapter.A["p"], adapter.B["p"], x], grad)

    # The same rows and a second group of base-only rows: the concatenated-deltas path.
    split = RowGroups([(0, rows, adapter), (rows, rows + 5, None)]).apply("p", xx, y.clone())
    assert torch.equal(split[:rows], fused)
    assert torch.equal(split[rows:], y[rows:])
    got = torch.autograd.grad(split, [adapter.A["p"], adapter.B["p"], x], torch.cat([grad, torch.zeros(5, d_out)]))
    for name, a, b in zip("ABx", want, got):
        assert torch.equal(a, b), name
