"""optim.optim_step against torch.optim.AdamW, and AdamParams validation."""

from __future__ import annotations

import math

import pytest
import torch

from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.training.optim import OptimizerState, optim_step
from whitney.errors import InvalidInput
from whitney.protocol.training import AdamParams

SHAPES = {"m.0.lora_A": (4, 8), "m.0.lora_B": (6, 4), "m.1.lora_A": (4, 5), "m.1.lora_B": (3, 4)}


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def _grad_seq(steps: int, seed: int = 1, scale: float = 1.0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [{name: torch.randn(shape, generator=g) * scale for name, shape in SHAPES.items()}
            for _ in range(steps)]


def _run_ours(hp: AdamParams, grad_seq, seed: int = 0):
    weights = _weights(seed)
    state = OptimizerState()
    metrics = []
    for gs in grad_seq:
        grads = {n: gs[n].clone() for n in SHAPES}
        metrics.append(optim_step(weights, grads, state, hp))
        assert grads == {}  # consumed
    return weights, state, metrics


def _run_torch(hp: AdamParams, grad_seq, seed: int = 0, clip: float | None = None, grad_mult: float = 1.0):
    weights = {n: t.clone().requires_grad_(True) for n, t in _weights(seed).items()}
    a = [t for n, t in weights.items() if not n.endswith(".lora_B")]
    b = [t for n, t in weights.items() if n.endswith(".lora_B")]
    common = dict(betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay, foreach=True)
    opt = torch.optim.AdamW([{"params": a, "lr": hp.learning_rate},
                             {"params": b, "lr": hp.learning_rate * hp.lora_plus_ratio}], **common)
    norms = []
    for gs in grad_seq:
        for n, t in weights.items():
            t.grad = gs[n].clone() * grad_mult
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(list(weights.values()), clip)))
        opt.step()
        opt.zero_grad()
    return {n: t.detach() for n, t in weights.items()}, norms


def _assert_weights_close(ours, ref, rtol=1e-6, atol=1e-7):
    assert set(ours) == set(ref)
    for n in ours:
        torch.testing.assert_close(ours[n], ref[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def test_matches_torch_adamw_with_weight_decay_bitwise():
    hp = AdamParams(learning_rate=3e-2, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    seq = _grad_seq(6)
    ours, state, _ = _run_ours(hp, seq)
    ref, _ = _run_torch(hp, seq)
    start = _weights()
    for n in ours:
        assert not torch.equal(ours[n], start[n]), f"{n} did not move"
        assert torch.equal(ours[n], ref[n]), f"{n}: max diff {(ours[n] - ref[n]).abs().max().item()}"
    assert state.step == 6


def test_matches_torch_adamw_default_hyperparameters():
    hp = AdamParams()  # Tinker's defaults: eps 1e-12, beta2 0.95, no weight decay
    seq = _grad_seq(4, seed=7)
    ours, _, _ = _run_ours(hp, seq)
    ref, _ = _run_torch(hp, seq)
    _assert_weights_close(ours, ref)


def test_weight_decay_is_decoupled():
    """With zero gradient and zero moments, AdamW only shrinks weights by (1 - lr * wd)."""
    hp = AdamParams(learning_rate=0.1, weight_decay=0.5)
    zero = [{n: torch.zeros(s) for n, s in SHAPES.items()}]
    ours, _, _ = _run_ours(hp, zero)
    for n, w0 in _weights().items():
        torch.testing.assert_close(ours[n], w0 * (1 - 0.1 * 0.5), rtol=0, atol=0)


def test_gradient_clip_norm_reports_preclip_norm_and_matches_clip_grad_norm():
    hp = AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.01, gradient_clip_norm=0.5)
    seq = _grad_seq(5, seed=3, scale=2.0)
    ours, _, metrics = _run_ours(hp, seq)
    ref, norms = _run_torch(hp, seq, clip=0.5)
    for m, gs, ref_norm in zip(metrics, seq, norms):
        expected = math.sqrt(sum(float(t.double().pow(2).sum()) for t in gs.values()))
        assert expected > 0.5 * 4  # clipping is really active
        assert m["grad_norm"] == pytest.approx(expected, rel=1e-12)
        assert m["grad_norm"] == pytest.approx(ref_norm, rel=1e-6)
    _assert_weights_close(ours, ref)
    # and clipping really changed the result
    unclipped, _, _ = _run_ours(AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.01), seq)
    assert any(not torch.allclose(unclipped[n], ours[n], rtol=1e-5, atol=1e-6) for n in ours)


def test_gradient_clip_inactive_below_threshold():
    hp_clip = AdamParams(learning_rate=1e-2, eps=1e-8, gradient_clip_norm=1e6)
    hp_none = AdamParams(learning_rate=1e-2, eps=1e-8)
    seq = _grad_seq(3)
    a, _, _ = _run_ours(hp_clip, seq)
    b, _, _ = _run_ours(hp_none, seq)
    for n in a:
        assert torch.equal(a[n], b[n])


def test_gradient_scale_applied_once_before_clipping():
    # scale 0.5 == halving the gradients, in grad_norm and in the update (with clipping active)
    seq = _grad_seq(4, seed=5, scale=3.0)
    halved = [{n: t * 0.5 for n, t in gs.items()} for gs in seq]
    hp_scaled = AdamParams(learning_rate=1e-2, eps=1e-8, gradient_clip_norm=1.0, gradient_scale=0.5)
    hp_plain = AdamParams(learning_rate=1e-2, eps=1e-8, gradient_clip_norm=1.0)
    w_scaled, _, m_scaled = _run_ours(hp_scaled, seq)
    w_half, _, m_half = _run_ours(hp_plain, halved)
    for a, b, gs in zip(m_scaled, m_half, seq):
        raw = math.sqrt(sum(float(t.double().pow(2).sum()) for t in gs.values()))
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-12)
        assert a["grad_norm"] == pytest.approx(0.5 * raw, rel=1e-9)
    for n in w_scaled:
        assert torch.equal(w_scaled[n], w_half[n])
    # vs torch: halve the grads, clip, AdamW
    ref, _ = _run_torch(hp_plain, seq, clip=1.0, grad_mult=0.5)
    _assert_weights_close(w_scaled, ref)


def test_gradient_scale_without_clipping_changes_adam_update_with_small_gradients():
    # Adam is scale-invariant except through eps: use eps comparable to the gradient to see the scale.
    seq = _grad_seq(2, seed=9, scale=1e-3)
    hp = AdamParams(learning_rate=1e-2, eps=1e-3, gradient_scale=4.0)
    ours, _, _ = _run_ours(hp, seq)
    ref, _ = _run_torch(AdamParams(learning_rate=1e-2, eps=1e-3), seq, grad_mult=4.0)
    _assert_weights_close(ours, ref)
    plain, _, _ = _run_ours(AdamParams(learning_rate=1e-2, eps=1e-3), seq)
    assert any(not torch.allclose(plain[n], ours[n], rtol=1e-4) for n in ours)


def test_lora_plus_ratio_uses_scaled_lr_for_B():
    hp = AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.05, lora_plus_ratio=16.0)
    seq = _grad_seq(4, seed=11)
    ours, _, metrics = _run_ours(hp, seq)
    ref, _ = _run_torch(hp, seq)
    _assert_weights_close(ours, ref)
    assert metrics[-1]["learning_rate"] == pytest.approx(1e-2)
    assert metrics[-1]["learning_rate_lora_B"] == pytest.approx(0.16)
    # A matrices are unaffected by the ratio, B matrices are not
    base, _, _ = _run_ours(AdamParams(learning_rate=1e-2, eps=1e-8, weight_decay=0.05), seq)
    for n in ours:
        if n.endswith(".lora_A"):
            assert torch.equal(ours[n], base[n])
        else:
            assert not torch.allclose(ours[n], base[n])


def test_grads_zeroed_and_step_counter_increments():
    weights = _weights()
    grads = {n: torch.randn(s) for n, s in SHAPES.items()}
    state = OptimizerState()
    hp = AdamParams(learning_rate=1e-3)
    for k in range(1, 4):
        metrics = optim_step(weights, grads, state, hp)
        assert state.step == k
        assert metrics["step"] == float(k)
        for n, g in grads.items():
            assert torch.count_nonzero(g) == 0, n
        for g in grads.values():
            g.normal_()
    # moments exist for every weight with the weight's shape
    assert set(state.exp_avg) == set(SHAPES) == set(state.exp_avg_sq)
    for n, s in SHAPES.items():
        assert tuple(state.exp_avg[n].shape) == s


def test_zero_gradient_step_reports_zero_norm():
    weights = _weights()
    grads = {n: torch.zeros(s) for n, s in SHAPES.items()}
    before = {n: t.clone() for n, t in weights.items()}
    m = optim_step(weights, grads, OptimizerState(), AdamParams(gradient_clip_norm=1.0))
    assert m["grad_norm"] == 0.0
    for n in weights:
        assert torch.equal(weights[n], before[n])


# ---- validation ------------------------------------------------------------------------------

BAD = [
    ("learning_rate", 0.0),
    ("learning_rate", -1e-4),
    ("learning_rate", float("nan")),
    ("learning_rate", float("inf")),
    ("learning_rate", True),
    ("learning_rate", "0.001"),
    ("beta1", 1.0),
    ("beta1", -0.1),
    ("beta2", -0.1),
    ("beta2", 1.0),
    ("eps", 0.0),
    ("eps", -1e-8),
    ("weight_decay", -0.01),
    ("weight_decay", float("nan")),
    ("gradient_clip_norm", -1.0),
    ("gradient_clip_norm", float("inf")),
    ("lora_plus_ratio", 0.0),
    ("lora_plus_ratio", -2.0),
    ("gradient_scale", 0.0),
    ("gradient_scale", float("-inf")),
    ("gradient_scale", float("nan")),
]


@pytest.mark.parametrize("name,value", BAD, ids=[f"{n}={v!r}" for n, v in BAD])
def test_invalid_params_raise_naming_field(name, value):
    with pytest.raises(InvalidInput) as e:
        AdamParams(**{name: value}).validate()
    assert e.value.field == name
    assert name in str(e.value)
    with pytest.raises(InvalidInput) as e:
        AdamParams.from_dict({name: value})
    assert e.value.field == name


def test_unknown_key_raises_naming_key():
    with pytest.raises(InvalidInput) as e:
        AdamParams.from_dict({"learning_rate": 1e-3, "momentum": 0.9})
    assert e.value.field == "momentum"
    assert "momentum" in str(e.value)


def test_valid_params_accepted():
    hp = AdamParams.from_dict({"learning_rate": 2e-4, "beta1": 0.0, "beta2": 0.0, "eps": 1e-8,
                               "weight_decay": 0.0, "gradient_clip_norm": 0.0, "lora_plus_ratio": 0.5,
                               "gradient_scale": 3})
    assert hp.learning_rate == 2e-4 and hp.gradient_scale == 3 and hp.beta1 == 0.0


# ---- through the Engine --------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine_run(tiny_llama):
    engine = Engine()
    engine.create_run("r", tiny_llama, LoraConfig(rank=4, seed=0, train_unembed=False))
    return engine


def _datum() -> Datum:
    return Datum(token_ids=[5, 17, 300, 42, 9], loss_inputs={"target_tokens": [17, 300, 42, 9, 77],
                                                             "weights": [1.0, 1.0, 1.0, 1.0, 1.0]})


@pytest.mark.parametrize("name,value", [("learning_rate", 0.0), ("beta1", 1.0), ("eps", 0.0),
                                        ("weight_decay", -1.0), ("gradient_scale", 0.0),
                                        ("lora_plus_ratio", 0.0), ("gradient_clip_norm", -0.5),
                                        ("nesterov", True)])
def test_engine_optim_step_validates_before_changing_anything(engine_run, name, value):
    run = engine_run.get_run("r")
    engine_run.forward_backward("r", [_datum()])
    before = {n: t.detach().clone() for n, t in run.weights().items()}
    grads_before = {n: g.clone() for n, g in run.grads.items()}
    step = run.optimizer.step
    assert any(torch.count_nonzero(g) for g in grads_before.values())
    with pytest.raises(InvalidInput) as e:
        engine_run.optim_step("r", {name: value})
    assert e.value.field == name
    with pytest.raises(InvalidInput):
        engine_run.optim_step("r", AdamParams(**{name: value}) if name != "nesterov" else {name: value})
    assert run.optimizer.step == step
    for n, t in run.weights().items():
        assert torch.equal(t, before[n])
        assert torch.equal(run.grads[n], grads_before[n])
    for g in run.grads.values():
        g.zero_()


def test_engine_optim_step_applies_adamw(engine_run):
    run = engine_run.create_run("adam", engine_run.get_run("r").base.name,
                                LoraConfig(rank=4, seed=1, train_unembed=True))
    engine_run.forward_backward("adam", [_datum()])
    engine_run.optim_step("adam", {"learning_rate": 1e-2})  # B != 0, so A also gets gradients
    engine_run.forward_backward("adam", [_datum()])
    w0 = {n: t.detach().clone() for n, t in run.weights().items()}
    g0 = {n: g.clone() for n, g in run.grads.items()}
    m0 = {n: t.clone() for n, t in run.optimizer.exp_avg.items()}
    v0 = {n: t.clone() for n, t in run.optimizer.exp_avg_sq.items()}
    assert all(torch.count_nonzero(g0[n]) for n in g0)
    step0 = run.optimizer.step
    assert step0 == 1
    hp = {"learning_rate": 1e-2, "weight_decay": 0.1, "gradient_clip_norm": 0.1, "eps": 1e-8}
    metrics = engine_run.optim_step("adam", hp)
    assert run.optimizer.step == step0 + 1 == int(metrics["step"])
    expected_norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in g0.values()))
    assert expected_norm > 0.1
    assert metrics["grad_norm"] == pytest.approx(expected_norm, rel=1e-12)
    # the same step with torch, from the run's optimizer state after step 1
    params = {n: t.clone().requires_grad_(True) for n, t in w0.items()}
    opt = torch.optim.AdamW(list(params.values()), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.1, foreach=False)
    for n, p in params.items():
        opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": m0[n].clone(), "exp_avg_sq": v0[n].clone()}
        p.grad = g0[n].clone()
    torch.nn.utils.clip_grad_norm_(list(params.values()), 0.1)
    opt.step()
    for n, t in run.weights().items():
        torch.testing.assert_close(t.detach(), params[n].detach(), rtol=1e-6, atol=1e-7)
    assert all(torch.count_nonzero(g) == 0 for g in run.grads.values())
    assert any(not torch.equal(t.detach(), w0[n]) for n, t in run.weights().items())
