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
