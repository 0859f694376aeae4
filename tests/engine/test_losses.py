"""Every token-summed loss against a float64 reference written here from its formula.

Function level: each loss's value, per-token loss, returned log-probs, metrics and its gradient with
respect to the learner log-probs l_t, computed in plain Python floats (float64) from the formula, with
inputs chosen so that clipping triggers for some tokens and not for others.

Engine level: on the tiny Llama and Qwen3, the log-probs the engine reports equal Hugging Face's
float64 log_softmax at the target tokens, and the gradient forward_backward accumulates for every
LoRA A and B equals autograd of the same loss through a float64 Hugging Face model with the LoRA
delta scale * B @ A added to each adapted weight.

Notation: l_t learner log-prob, q_t old_logprobs, r_t = exp(l_t - q_t), A_t advantage, w_t weight.
"""

from __future__ import annotations

import itertools
import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from whitney.engine import Datum, Engine, LoraConfig
from whitney.engine.losses import builtin as losses
from whitney.engine.losses.builtin import CISPO_DEFAULT_EPS_MAX, LOSSES, loss_spec
from whitney.errors import InvalidInput

# ---- shared helpers (test_opsd.py imports these) --------------------------------------------------

_HF: dict[str, torch.nn.Module] = {}
_RUN_IDS = itertools.count()


def hf64(path: str) -> torch.nn.Module:
    """The Hugging Face model at `path`, loaded as float32 (as the engine does) and upcast to float64."""
    if path not in _HF:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).double().eval()
        for p in model.parameters():
            p.requires_grad_(False)
        _HF[path] = model
    return _HF[path]


def new_run_id(prefix: str = "run") -> str:
    return f"{prefix}-{next(_RUN_IDS)}"


def randomize_B(run, seed: int, std: float = 0.05) -> None:
    """Give a run's adapter nonzero B (a fresh run has B = 0) so it differs from the base model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in run.adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=gen) * std)


def leaf_adapter64(run) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Float64 copies of the run's A and B that require grad (the reference's parameters)."""
    A = {k: v.detach().double().requires_grad_(True) for k, v in run.adapter.A.items()}
    B = {k: v.detach().double().requires_grad_(True) for k, v in run.adapter.B.items()}
    return A, B


def lora_weights(model: torch.nn.Module, A: dict, B: dict, scale: float) -> dict[str, torch.Tensor]:
    """W + scale * B @ A for each adapted module, keyed by HF parameter name (differentiable in A, B)."""
    return {f"{k}.weight": model.get_submodule(k).weight + scale * B[k] @ A[k] for k in A}


def ref_logits(model: torch.nn.Module, tokens: list[int], weights: dict | None = None) -> torch.Tensor:
    """Float64 logits [N, V] of the HF model, with `weights` (from lora_weights) replacing its own."""
    # tie_weights=False: replacing lm_head.weight must not replace the (tied) embedding.
    out = torch.func.functional_call(model, weights or {}, (torch.tensor([tokens]),), tie_weights=False)
    return out.logits[0]


def ref_target_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    lp = torch.log_softmax(logits, dim=-1)
    if targets.dim() == 1:
        return lp.gather(-1, targets[:, None])[:, 0]
    return lp.gather(-1, targets)


def assert_grads_match(run, A: dict, B: dict, ref_loss: torch.Tensor, rtol: float = 1e-4) -> None:
    """The run's accumulated gradients equal d(ref_loss)/d(A, B), tensor by tensor."""
    names = list(A)
    grads = torch.autograd.grad(ref_loss, [A[k] for k in names] + [B[k] for k in names], allow_unused=True)
    ref = {f"{k}.lora_A": g for k, g in zip(names, grads[: len(names)])}
    ref.update({f"{k}.lora_B": g for k, g in zip(names, grads[len(names):])})
    assert set(ref) == set(run.grads)
    nonzero = 0
    for key, g in ref.items():
        assert g is not None, key
        got = run.grads[key].double()
        scale = float(g.abs().max())
        nonzero += scale > 0
        torch.testing.assert_close(got, g, rtol=rtol, atol=rtol * scale + 1e-12, msg=lambda m, k=key: f"{k}: {m}")
    assert nonzero == len(ref), "every reference gradient should be nonzero (B != 0 and A != 0)"


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ---- function-level inputs ------------------------------------------------------------------------

# Ratios r_t and advantages A_t chosen to hit every PPO/CISPO case away from any bound used below
# (0.8, 1.2, 0.6, 1.4, 1.3, 5.0): below/inside/above the range, each with A > 0 and A < 0.
RATIOS = [0.5, 0.75, 0.85, 0.95, 1.0, 1.05, 1.15, 1.25, 1.6, 3.0, 7.0, 0.3, 0.55, 1.5, 9.0, 0.9]
ADVS = [1.3, -0.7, 0.4, -1.1, 0.9, -0.2, 1.5, -0.8, 0.6, -1.2, 2.0, -0.5, -0.9, 0.7, -1.4, 0.0]
LPS = [-0.3, -2.1, -4.7, -0.05, -1.6, -3.3, -0.9, -6.2, -2.8, -0.4, -1.1, -5.5, -0.7, -3.9, -2.2, -1.35]


@pytest.fixture
def rl():
    """(l as a float32 leaf, inputs {old_logprobs, advantages} float32) with exp(l - q) = RATIOS."""
    l = f32(LPS)
    q = l.double() - torch.log(torch.tensor(RATIOS, dtype=torch.float64))
    inputs = {"old_logprobs": q.float(), "advantages": f32(ADVS)}
    return l.clone().requires_grad_(True), inputs


def run_loss(name: str, config: dict, lp: torch.Tensor, inputs: dict):
    """Parse the config through the loss's own parser, apply the loss, return (output, d loss / d lp)."""
    spec = loss_spec(name)
    out = spec.fn(lp, inputs, spec.config(config))
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out, grad


def as64(t: torch.Tensor) -> list[float]:
    return [float(x) for x in t.detach().double().flatten()]


def check_against(out, grad, ref_tokens: list[float], ref_grad: list[float], lp: torch.Tensor,
                  rtol: float = 1e-5) -> None:
    """Loss (sum), per-token loss, gradient and returned log-probs against the float64 reference."""
    ref_loss = math.fsum(ref_tokens)
    assert out.loss.dim() == 0
    assert float(out.loss.detach()) == pytest.approx(ref_loss, rel=rtol, abs=1e-6)
    torch.testing.assert_close(out.elementwise.double(), torch.tensor(ref_tokens, dtype=torch.float64),
                               rtol=rtol, atol=1e-6)
    torch.testing.assert_close(grad.double(), torch.tensor(ref_grad, dtype=torch.float64).reshape(grad.shape),
                               rtol=rtol, atol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(ref_loss, rel=rtol, abs=1e-6)
    assert out.metrics["tokens:sum"] == lp.shape[0]
    assert not out.elementwise.requires_grad and not out.logprobs.requires_grad


def rl_values(lp: torch.Tensor, inputs: dict) -> list[tuple[float, float, float]]:
    """(l_t, q_t, A_t) as float64 Python numbers, from the exact float32 values the loss sees."""
    return list(zip(as64(lp), as64(inputs["old_logprobs"]), as64(inputs["advantages"])))


# ---- cross_entropy --------------------------------------------------------------------------------


def test_cross_entropy_hard_targets_value_and_gradient():
    l = f32(LPS).requires_grad_(True)
    w = f32([1.0, 0.5, -0.3, 2.0, 0.0, 1.0, -1.5, 0.25, 1.0, 3.0, -0.7, 1.0, 0.1, 1.0, -2.0, 0.6])
    out, grad = run_loss("cross_entropy", {}, l, {"weights": w})
    ref_tokens = [-wt * lt for lt, wt in zip(as64(l), as64(w))]  # L = -sum w_t l_t
    ref_grad = [-wt for wt in as64(w)]  # dL/dl_t = -w_t
    check_against(out, grad, ref_tokens, ref_grad, l)
    torch.testing.assert_close(out.logprobs, l.detach())


def test_cross_entropy_unit_weights_is_negative_logprob_sum():
    l = f32(LPS).requires_grad_(True)
    out, grad = run_loss("cross_entropy", {}, l, {"weights": torch.ones(len(LPS))})
    assert float(out.loss.detach()) == pytest.approx(-math.fsum(as64(l)), rel=1e-6)
    torch.testing.assert_close(grad, -torch.ones(len(LPS)))


def test_cross_entropy_soft_targets_value_gradient_and_shown_logprob():
    gen = torch.Generator().manual_seed(3)
    N, K = 6, 3
    l = (-torch.rand(N, K, generator=gen) * 5).requires_grad_(True)
    # Weights with negative entries (and one row whose weights are all negative) but nonzero row sums.
    w = f32([[0.7, 0.2, 0.1], [1.0, -0.5, 0.8], [-0.2, -0.3, -0.5], [0.0, 1.0, 0.0],
             [2.0, 0.5, -1.0], [0.3, 0.3, 0.4]])
    out, grad = run_loss("cross_entropy", {}, l, {"weights": w})
    L, W = l.detach().double().tolist(), w.double().tolist()
    ref_tokens = [-math.fsum(W[t][k] * L[t][k] for k in range(K)) for t in range(N)]
    ref_grad = [-W[t][k] for t in range(N) for k in range(K)]
    ref_shown = [math.fsum(W[t][k] * L[t][k] for k in range(K)) / math.fsum(W[t]) for t in range(N)]
    check_against(out, grad, ref_tokens, ref_grad, l)
    assert out.logprobs.shape == (N,) and out.elementwise.shape == (N,)
    torch.testing.assert_close(out.logprobs.double(), torch.tensor(ref_shown, dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)


# ---- importance_sampling --------------------------------------------------------------------------


def test_importance_sampling_value_and_gradient(rl):
    l, inputs = rl
    out, grad = run_loss("importance_sampling", {}, l, inputs)
    ref_tokens, ref_grad, ratios = [], [], []
    for lt, qt, at in rl_values(l, inputs):
        r = math.exp(lt - qt)
        ratios.append(r)
        ref_tokens.append(-r * at)  # L = -sum r_t A_t
        ref_grad.append(-r * at)  # dr/dl = r
    check_against(out, grad, ref_tokens, ref_grad, l)
    assert out.metrics["ratio:mean"] == pytest.approx(sum(ratios) / len(ratios), rel=1e-5)
    torch.testing.assert_close(out.logprobs, l.detach())


# ---- ppo ------------------------------------------------------------------------------------------


def ppo_reference(values, low: float, high: float):
    """L = -sum min(r A, clip(r, low, high) A); the gradient is -r A where the unclipped term is the min."""
    tokens, grads, clipped = [], [], 0
    for lt, qt, at in values:
        r = math.exp(lt - qt)
        c = min(max(r, low), high)
        unclipped, clip_term = r * at, c * at
        tokens.append(-min(unclipped, clip_term))
        if unclipped <= clip_term:
            grads.append(-r * at)
        else:
            grads.append(0.0)
            clipped += 1
    return tokens, grads, clipped / len(values)


@pytest.mark.parametrize("config,low,high", [
    ({}, 0.8, 1.2),  # defaults clip_low = clip_high = 0.2
    ({"clip_low": 0.2, "clip_high": 0.2}, 0.8, 1.2),
    ({"clip_low": 0.4, "clip_high": 0.4}, 0.6, 1.4),
    ({"clip_low": 0.35, "clip_high": 0.3}, 0.65, 1.3),  # asymmetric
    ({"clip_low_threshold": 0.6, "clip_high_threshold": 1.4}, 0.6, 1.4),  # Tinker's absolute form
    ({"clip_high_threshold": 1.3}, 0.8, 1.3),  # the absent absolute bound defaults to 0.8
])
def test_ppo_value_and_gradient(rl, config, low, high):
    l, inputs = rl
    out, grad = run_loss("ppo", config, l, inputs)
    ref_tokens, ref_grad, frac = ppo_reference(rl_values(l, inputs), low, high)
    check_against(out, grad, ref_tokens, ref_grad, l)
    assert out.metrics["clipped_fraction:mean"] == pytest.approx(frac)
    # The inputs really exercise both branches: some tokens clipped (zero gradient), most not.
    assert 0 < frac < 1
    assert int((grad == 0).sum()) >= round(frac * len(RATIOS))
    torch.testing.assert_close(out.logprobs, l.detach())


def test_ppo_clipping_pattern_is_the_one_expected():
    """With the default range [0.8, 1.2] the clipped tokens are exactly those where the clipped term is smaller."""
    l = f32([-1.0] * 6).requires_grad_(True)
    ratios, advs = [1.5, 1.5, 0.5, 0.5, 1.1, 0.9], [1.0, -1.0, 1.0, -1.0, 1.0, -1.0]
    q = (l.detach().double() - torch.log(torch.tensor(ratios, dtype=torch.float64))).float()
    out, grad = run_loss("ppo", {}, l, {"old_logprobs": q, "advantages": f32(advs)})
    # r=1.5,A>0: clipped at 1.2 (no grad); r=1.5,A<0: unclipped; r=0.5,A>0: unclipped; r=0.5,A<0: clipped at 0.8.
    expected = torch.tensor([0.0, 1.5, -0.5, 0.0, -1.1, 0.9], dtype=torch.float64)
    torch.testing.assert_close(grad.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.elementwise.double(),
                               torch.tensor([-1.2, 1.5, -0.5, 0.8, -1.1, 0.9], dtype=torch.float64),
                               rtol=1e-5, atol=1e-6)
    assert out.metrics["clipped_fraction:mean"] == pytest.approx(2 / 6)


# ---- cispo ----------------------------------------------------------------------------------------


def cispo_reference(values, low: float, high: float):
    """L = -sum sg(clip(r, low, high)) A l; the ratio is a constant, so dL/dl = -clip(r) A."""
    tokens, grads, clipped = [], [], 0
    for lt, qt, at in values:
        r = math.exp(lt - qt)
        c = min(max(r, low), high)
        clipped += c != r
        tokens.append(-c * at * lt)
        grads.append(-c * at)
    return tokens, grads, clipped / len(values)


@pytest.mark.parametrize("config,low,high", [
    ({}, 0.0, CISPO_DEFAULT_EPS_MAX),
    ({"eps_max": 1.3}, 0.0, 1.3),
    ({"eps_max": 2}, 0.0, 2.0),
    ({"clip_low_threshold": 0.6, "clip_high_threshold": 1.4}, 0.6, 1.4),  # absolute form clips below too
])
def test_cispo_value_and_gradient(rl, config, low, high):
    l, inputs = rl
    out, grad = run_loss("cispo", config, l, inputs)
    values = rl_values(l, inputs)
    ref_tokens, ref_grad, frac = cispo_reference(values, low, high)
    check_against(out, grad, ref_tokens, ref_grad, l)
    assert out.metrics["clipped_fraction:mean"] == pytest.approx(frac)
    assert 0 < frac < 1
    # The ratio is detached: the gradient is NOT d/dl [clip(r) A l] = -(clip(r) A + A l r [r unclipped]).
    through_ratio = [-(min(max(math.exp(lt - qt), low), high) * at
                       + (at * lt * math.exp(lt - qt) if low < math.exp(lt - qt) < high else 0.0))
                     for lt, qt, at in values]
    unclipped = [low < math.exp(lt - qt) < high and at != 0 for lt, qt, at in values]
    differs = [abs(g - t) > 1e-3 for g, t in zip(grad.tolist(), through_ratio)]
    assert differs == unclipped and sum(unclipped) >= 5


def test_cispo_default_eps_max_value():
    assert CISPO_DEFAULT_EPS_MAX == 5.0
    assert loss_spec("cispo").config({}) == {"low": 0.0, "high": CISPO_DEFAULT_EPS_MAX}


# ---- dro ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config,beta", [({}, 0.05), ({"beta": 0.3}, 0.3), ({"beta": 0}, 0.0), ({"beta": 2}, 2.0)])
def test_dro_value_and_gradient(rl, config, beta):
    l, inputs = rl
    out, grad = run_loss("dro", config, l, inputs)
    ref_tokens, ref_grad = [], []
    for lt, qt, at in rl_values(l, inputs):
        ref_tokens.append(-(lt * at - beta / 2 * (lt - qt) ** 2))  # L = -sum [l A - beta/2 (l - q)^2]
        ref_grad.append(-(at - beta * (lt - qt)))
    check_against(out, grad, ref_tokens, ref_grad, l)
    torch.testing.assert_close(out.logprobs, l.detach())


# ---- gspo -----------------------------------------------------------------------------------------

# Three datums of the 16 RL positions (sizes 6, 5, 5); the mask leaves some positions of each unmarked
# (a prompt), so the sequence ratio is not the mean over the whole datum.
GSPO_ROWS = [0] * 6 + [1] * 5 + [2] * 5
GSPO_MASK = [0, 0, 0, 1, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]


def gspo_reference(values, rows, mask, low: float, high: float):
    """Per datum b: s_b = exp(mean over marked t of l_t - q_t); token t of b: -min(s_b A_t, clip(s_b) A_t).
    s_t = sg(s_b) exp(l_t - sg(l_t)), so dL/dl_t = -s_b A_t where the unclipped term is the min, else 0."""
    log_s = {}
    for b in set(rows):
        marked = [lt - qt for (lt, qt, _), r, m in zip(values, rows, mask) if r == b and m]
        log_s[b] = math.fsum(marked) / len(marked)
    tokens, grads, clipped = [], [], 0
    for (lt, qt, at), b in zip(values, rows):
        s = math.exp(log_s[b])
        c = min(max(s, low), high)
        tokens.append(-min(s * at, c * at))
        unclipped = s * at <= c * at
        grads.append(-s * at if unclipped else 0.0)
        clipped += not unclipped
    return tokens, grads, clipped / len(values), {b: math.exp(v) for b, v in log_s.items()}


@pytest.mark.parametrize("config,low,high", [
    ({}, 0.8, 1.2),
    ({"clip_low": 0.05, "clip_high": 0.1}, 0.95, 1.1),
    ({"clip_low_threshold": 0.9, "clip_high_threshold": 1.05}, 0.9, 1.05),
])
def test_gspo_value_and_gradient(rl, config, low, high):
    l, inputs = rl
    inputs = {**inputs, "sequence_ratio_mask": f32(GSPO_MASK), "datum_index": torch.tensor(GSPO_ROWS)}
    out, grad = run_loss("gspo", config, l, inputs)
    ref_tokens, ref_grad, frac, s = gspo_reference(rl_values(l, inputs), GSPO_ROWS, GSPO_MASK, low, high)
    check_against(out, grad, ref_tokens, ref_grad, l)
    assert out.metrics["clipped_fraction:mean"] == pytest.approx(frac)
    torch.testing.assert_close(out.logprobs, l.detach())
    # The datums really differ: one sequence ratio inside the range, others outside it.
    inside = [low < v < high for v in s.values()]
    assert any(inside) and not all(inside), s


def test_gspo_ratio_is_one_per_datum_and_its_gradient_stops_at_the_mean(rl):
    """Every position of a datum carries the same ratio (unmarked positions too), and the gradient is
    NOT the one through the sequence mean (GSPO-token's stop-gradient)."""
    l, inputs = rl
    inputs = {**inputs, "sequence_ratio_mask": f32(GSPO_MASK), "datum_index": torch.tensor(GSPO_ROWS)}
    out, grad = run_loss("gspo", {"clip_low_threshold": 0.0, "clip_high_threshold": 100.0}, l, inputs)
    adv = inputs["advantages"].double()
    ratio = out.elementwise.double() / -adv  # unclipped: per-token loss = -s_b A_t
    for b in range(3):
        on = [i for i, r in enumerate(GSPO_ROWS) if r == b and ADVS[i] != 0]
        assert max(ratio[on]) - min(ratio[on]) < 1e-5 * float(ratio[on].abs().max())
    # Through the mean: d/dl_t [exp(mean(l - q)) A] adds s_b * sum_u A_u / |M| on marked positions.
    lp = l.detach().double().requires_grad_(True)
    q = inputs["old_logprobs"].double()
    rows, mask = torch.tensor(GSPO_ROWS), torch.tensor(GSPO_MASK, dtype=torch.bool)
    naive = torch.zeros((), dtype=torch.float64)
    for b in range(3):
        sel = rows == b
        naive = naive - (torch.exp((lp - q)[sel & mask].mean()) * adv[sel]).sum()
    (naive_grad,) = torch.autograd.grad(naive, lp)
    assert (grad.double() - naive_grad).abs().max() > 1e-2


# ---- config and name validation -------------------------------------------------------------------


def test_unknown_loss_name_is_invalid_input():
    with pytest.raises(InvalidInput) as e:
        loss_spec("kl_divergence")
    assert e.value.field == "loss_fn"
    assert "cross_entropy" in e.value.message and "opsd" in e.value.message


@pytest.mark.parametrize("name,config,key", [
    ("cross_entropy", {"beta": 0.1}, "beta"),
    ("importance_sampling", {"clip_low": 0.2}, "clip_low"),
    ("ppo", {"eps_max": 2.0}, "eps_max"),
    ("ppo", {"clip": 0.2}, "clip"),
    ("cispo", {"clip_low": 0.2}, "clip_low"),
    ("dro", {"clip_high": 0.2}, "clip_high"),
    ("gspo", {"eps_max": 2.0}, "eps_max"),
    ("opsd", {"beta": 0.1}, "beta"),
])
def test_unknown_config_key_is_invalid_input(name, config, key):
    with pytest.raises(InvalidInput) as e:
        loss_spec(name).config(config)
    assert e.value.field == f"loss_config.{key}"


@pytest.mark.parametrize("name,config,key", [
    ("ppo", {"clip_low": 1.5}, "clip_low"),
    ("ppo", {"clip_low": -0.1}, "clip_low"),
    ("ppo", {"clip_high": -0.2}, "clip_high"),
    ("ppo", {"clip_low": float("nan")}, "clip_low"),
    ("ppo", {"clip_high": float("inf")}, "clip_high"),
    ("ppo", {"clip_low": True}, "clip_low"),
    ("ppo", {"clip_low": "0.2"}, "clip_low"),
    ("ppo", {"clip_low_threshold": 1.5}, "clip_low_threshold"),
    ("ppo", {"clip_low_threshold": -0.1}, "clip_low_threshold"),
    ("ppo", {"clip_high_threshold": 0.9}, "clip_high_threshold"),
    ("ppo", {"clip_high_threshold": float("nan")}, "clip_high_threshold"),
    ("cispo", {"eps_max": 0}, "eps_max"),
    ("cispo", {"eps_max": -1.0}, "eps_max"),
    ("cispo", {"eps_max": float("nan")}, "eps_max"),
    ("cispo", {"clip_high_threshold": 0.5}, "clip_high_threshold"),
    ("dro", {"beta": -1}, "beta"),
    ("dro", {"beta": float("nan")}, "beta"),
    # An explicit null is not a number: it must not slip through as None (crash or silently no clipping).
    ("dro", {"beta": None}, "beta"),
    ("ppo", {"clip_low": None}, "clip_low"),
    ("ppo", {"clip_low_threshold": None, "clip_high_threshold": 1.3}, "clip_low_threshold"),
    ("cispo", {"eps_max": None}, "eps_max"),
    ("gspo", {"clip_high_threshold": 0.99}, "clip_high_threshold"),
    ("gspo", {"clip_low": float("inf")}, "clip_low"),
])
def test_out_of_range_config_is_invalid_input(name, config, key):
    with pytest.raises(InvalidInput) as e:
        loss_spec(name).config(config)
    assert e.value.field == f"loss_config.{key}"


@pytest.mark.parametrize("name,config,field", [
    ("ppo", {"clip_low": 0.2, "clip_low_threshold": 0.8}, "loss_config.clip_low_threshold"),
    ("ppo", {"clip_high": 0.2, "clip_high_threshold": 1.2}, "loss_config.clip_high_threshold"),
    ("ppo", {"clip_low": 0.2, "clip_high_threshold": 1.2}, "loss_config.clip_high_threshold"),
    ("cispo", {"eps_max": 2.0, "clip_high_threshold": 1.3}, "loss_config.clip_high_threshold"),
    ("gspo", {"clip_high": 0.2, "clip_low_threshold": 0.9}, "loss_config.clip_low_threshold"),
])
def test_both_clip_forms_is_invalid_input(name, config, field):
    with pytest.raises(InvalidInput) as e:
        loss_spec(name).config(config)
    assert e.value.field == field


def test_config_parsers_fill_defaults():
    assert LOSSES["ppo"].config({}) == {"low": pytest.approx(0.8), "high": pytest.approx(1.2)}
    assert LOSSES["ppo"].config({"clip_low": 1, "clip_high": 0}) == {"low": 0.0, "high": 1.0}
    assert LOSSES["ppo"].config({"clip_low_threshold": 0.5}) == {"low": 0.5, "high": 1.2}
    assert LOSSES["dro"].config({}) == {"beta": 0.05}
    assert LOSSES["cross_entropy"].config({}) == {}
    assert LOSSES["importance_sampling"].config({}) == {}
    assert LOSSES["gspo"].config({}) == {"low": pytest.approx(0.8), "high": pytest.approx(1.2)}
    assert LOSSES["gspo"].config({"clip_high_threshold": 1.01}) == {"low": 0.8, "high": 1.01}
    assert set(losses.LOSS_NAMES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo", "opsd",
                                      "custom"}


def test_the_table_declares_each_loss_once_as_plain_data():
    """One entry per name (opsd included); its description is JSON; every default passes its own rule."""
    assert all(name == spec.name for name, spec in LOSSES.items())
    described = json.loads(json.dumps(losses.describe()))
    assert set(described) == set(LOSSES)
    assert described["opsd"]["passes"] == ["teacher"] and described["gspo"]["passes"] == []
    assert described["gspo"]["required_inputs"] == ["advantages", "old_logprobs", "sequence_ratio_mask",
                                                    "target_tokens"]
    assert described["cross_entropy"]["optional_inputs"] == ["weights"]
    assert described["cispo"]["tinker_defaults"] == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    for name, spec in LOSSES.items():
        for key, default in described[name]["config"].items():
            spec.config({key: default})  # does not raise
        assert set(spec.required) <= set(spec.inputs)


@pytest.mark.parametrize("name", ["stable_reinforce"])
def test_sdk_losses_not_served_say_so(name):
    with pytest.raises(InvalidInput) as e:
        loss_spec(name)
    assert e.value.field == "loss_fn" and "not served" in e.value.message and "gspo" in e.value.message


# ---- engine level ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine()


LORA = LoraConfig(rank=4, alpha=8.0, seed=1)
SEQS = [[5, 17, 300, 42, 9, 1000, 77, 4321], [8, 2000, 3, 11, 4], [12345, 6, 49151]]


def test_engine_logprobs_equal_hf_float64(engine, tiny_model):
    """A fresh run (B = 0) is the base model: its log-probs are HF's at the target tokens."""
    rid = new_run_id()
    engine.create_run(rid, tiny_model, LORA)
    targets = [s[1:] + [s[0]] for s in SEQS]
    data = [Datum(s, {"target_tokens": t}) for s, t in zip(SEQS, targets)]
    data[1] = Datum([SEQS[1][:2], SEQS[1][2:]], {"target_tokens": {"dtype": "int64", "shape": [5],
                                                                   "values": targets[1]}})  # chunks, wire form
    res = engine.forward(rid, data)
    model = hf64(tiny_model)
    with torch.no_grad():
        total = 0.0
        for s, t, o in zip(SEQS, targets, res.outputs):
            ref = ref_target_logprobs(ref_logits(model, s), torch.tensor(t))
            assert len(o.logprobs) == len(s)
            torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), ref, rtol=1e-5, atol=2e-5)
            total -= float(ref.sum())
    assert res.loss == pytest.approx(total, rel=1e-5)
    assert res.metrics["tokens:sum"] == sum(map(len, SEQS))
    # Sanity: these are real, non-uniform log-probs (not log(1/V) everywhere).
    flat = [x for o in res.outputs for x in o.logprobs]
    assert max(flat) - min(flat) > 0.5
    engine.delete_run(rid)


def rl_inputs(lp: list[float], offset: int) -> tuple[list[float], list[float]]:
    """old_logprobs with exp(lp - q) cycling through RATIOS, and advantages cycling through ADVS."""
    r = [RATIOS[(offset + i) % len(RATIOS)] for i in range(len(lp))]
    a = [ADVS[(offset + i) % len(ADVS)] or 0.45 for i in range(len(lp))]
    return [x - math.log(ri) for x, ri in zip(lp, r)], a


def torch_reference(name: str, cfg: dict, lp: torch.Tensor, x: dict) -> torch.Tensor:
    """Per-token loss [N] from the formula, differentiable, in float64."""
    if name == "cross_entropy":
        w = x["weights"]
        return -(w * lp).sum(-1) if lp.dim() == 2 else -(w * lp)
    q, adv = x["old_logprobs"], x["advantages"]
    r = torch.exp(lp - q)
    if name == "importance_sampling":
        return -r * adv
    if name == "ppo":
        return -torch.minimum(r * adv, r.clamp(cfg["low"], cfg["high"]) * adv)
    if name == "cispo":
        return -r.detach().clamp(cfg["low"], cfg["high"]) * adv * lp
    if name == "dro":
        return -(lp * adv - cfg["beta"] / 2 * (lp - q) ** 2)
    if name == "gspo":  # one datum: its ratio's value from the marked positions, each l_t's own gradient
        log_s = (lp.detach() - q)[x["sequence_ratio_mask"] != 0].mean()
        s = torch.exp(log_s + lp - lp.detach())
        return -torch.minimum(s * adv, s.clamp(cfg["low"], cfg["high"]) * adv)
    raise AssertionError(name)


# Every loss on the Llama; on the Qwen3 (q/k norms, untied lm_head) the hard-target CE and PPO.
ENGINE_CASES = [
    ("llama", "cross_entropy", {}, {}),
    ("llama", "cross_entropy_soft", {}, {}),
    ("llama", "importance_sampling", {}, {}),
    ("llama", "ppo", {}, {"low": 0.8, "high": 1.2}),
    ("llama", "ppo", {"clip_low_threshold": 0.6, "clip_high_threshold": 1.4}, {"low": 0.6, "high": 1.4}),
    ("llama", "cispo", {"eps_max": 1.3}, {"low": 0.0, "high": 1.3}),
    ("llama", "dro", {"beta": 0.3}, {"beta": 0.3}),
    ("llama", "gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"low": 0.9, "high": 1.1}),
    ("qwen3", "cross_entropy", {}, {}),
    ("qwen3", "ppo", {}, {"low": 0.8, "high": 1.2}),
]


@pytest.mark.parametrize("kind,case,config,ref_cfg", ENGINE_CASES,
                         ids=[f"{c[0]}-{c[1]}{c[2] or ''}" for c in ENGINE_CASES])
def test_engine_gradient_matches_float64_reference(engine, request, kind, case, config, ref_cfg):
    """forward_backward's accumulated dL/dA and dL/dB for every adapted module (attention, MLP,
    lm_head) equal autograd through a float64 HF model with W + scale * B @ A."""
    tiny_model = request.getfixturevalue(f"tiny_{kind}")
    rid = new_run_id()
    run = engine.create_run(rid, tiny_model, LORA)
    randomize_B(run, seed=7)
    name = "cross_entropy" if case.startswith("cross_entropy") else case
    seqs = SEQS[:2]
    targets = [s[1:] + [s[0]] for s in seqs]
    gen = torch.Generator().manual_seed(11)
    data, inputs64 = [], []
    if name != "cross_entropy":
        current = engine.forward(rid, [Datum(s, {"target_tokens": t}) for s, t in zip(seqs, targets)])
    for i, (s, t) in enumerate(zip(seqs, targets)):
        if case == "cross_entropy":
            w = [[1.0, -0.5, 2.0, 0.3][j % 4] for j in range(len(s))]  # negative weights included
            data.append(Datum(s, {"target_tokens": t, "weights": w}))
            inputs64.append({"targets": torch.tensor(t), "weights": torch.tensor(w, dtype=torch.float64)})
        elif case == "cross_entropy_soft":
            K = 3
            cand = torch.randint(0, 49152, (len(s), K), generator=gen)
            cand[:, 0] = torch.tensor(t)
            w = torch.tensor([[0.6, 0.3, 0.1], [1.0, -0.4, 0.4]] * len(s), dtype=torch.float32)[: len(s)]
            data.append(Datum(s, {"target_tokens": {"dtype": "int64", "shape": [len(s), K],
                                                    "values": cand.flatten().tolist()},
                                  "weights": {"dtype": "float32", "shape": [len(s), K],
                                              "values": w.flatten().tolist()}}))
            inputs64.append({"targets": cand, "weights": w.double()})
        else:
            q, a = rl_inputs(current.outputs[i].logprobs, offset=5 * i)
            # the Tinker alias "logprobs" for old_logprobs on one datum
            key = "logprobs" if i == 1 else "old_logprobs"
            data.append(Datum(s, {"target_tokens": t, key: q, "advantages": a}))
            inputs64.append({"targets": torch.tensor(t),
                             "old_logprobs": torch.tensor(q, dtype=torch.float32).double(),
                             "advantages": torch.tensor(a, dtype=torch.float32).double()})
            if name == "gspo":  # the sequence ratio over all but the first (prompt) position
                data[-1].loss_inputs["sequence_ratio_mask"] = [0.0] + [1.0] * (len(s) - 1)
                inputs64[-1]["sequence_ratio_mask"] = torch.tensor([0.0] + [1.0] * (len(s) - 1))
    res = engine.forward_backward(rid, data, loss_fn=name, loss_config=config)

    model = hf64(tiny_model)
    A, B = leaf_adapter64(run)
    weights = lora_weights(model, A, B, run.adapter.scale)
    total = torch.zeros((), dtype=torch.float64)
    for s, x, o in zip(seqs, inputs64, res.outputs):
        lp = ref_target_logprobs(ref_logits(model, s, weights), x["targets"])
        per_token = torch_reference(name, ref_cfg, lp, x)
        total = total + per_token.sum()
        torch.testing.assert_close(torch.tensor(o.elementwise_loss, dtype=torch.float64), per_token.detach(),
                                   rtol=1e-4, atol=1e-4)
        shown = lp.detach() if lp.dim() == 1 else (x["weights"] * lp.detach()).sum(-1) / x["weights"].sum(-1)
        torch.testing.assert_close(torch.tensor(o.logprobs, dtype=torch.float64), shown, rtol=1e-5, atol=2e-5)
    assert res.loss == pytest.approx(float(total.detach()), rel=1e-4, abs=1e-4)
    if name in ("ppo", "cispo"):
        assert 0 < res.metrics["clipped_fraction:mean"] < 1
    assert_grads_match(run, A, B, total)
    engine.delete_run(rid)


def test_engine_rejects_unknown_loss_and_bad_config_without_gradients(engine, tiny_llama):
    rid = new_run_id()
    run = engine.create_run(rid, tiny_llama, LORA)
    datum = Datum([1, 2, 3], {"target_tokens": [2, 3, 4], "old_logprobs": [-1.0] * 3, "advantages": [1.0] * 3})
    with pytest.raises(InvalidInput) as e:
        engine.forward_backward(rid, [datum], loss_fn="grpo")
    assert e.value.field == "loss_fn"
    for config, field in [({"clip_low": 1.5}, "loss_config.clip_low"), ({"beta": 0.1}, "loss_config.beta"),
                          ({"clip_low": 0.1, "clip_low_threshold": 0.9}, "loss_config.clip_low_threshold")]:
        with pytest.raises(InvalidInput) as e:
            engine.forward_backward(rid, [datum], loss_fn="ppo", loss_config=config)
        assert e.value.field == field
    assert all(float(g.abs().sum()) == 0 for g in run.grads.values())
    # gspo: a datum whose sequence_ratio_mask marks nothing has no sequence ratio.
    marked = Datum([1, 2, 3], {**datum.loss_inputs, "sequence_ratio_mask": [0.0, 1.0, 1.0]})
    unmarked = Datum([1, 2, 3], {**datum.loss_inputs, "sequence_ratio_mask": [0.0, 0.0, 0.0]})
    with pytest.raises(InvalidInput) as e:
        engine.forward_backward(rid, [marked, unmarked], loss_fn="gspo")
    assert (e.value.field, e.value.datum_index) == ("sequence_ratio_mask", 1)
    with pytest.raises(InvalidInput) as e:
        engine.forward_backward(rid, [datum], loss_fn="gspo")
    assert e.value.field == "sequence_ratio_mask" and "required" in e.value.message
    assert not run.grads or all(float(g.abs().sum()) == 0 for g in run.grads.values())
    engine.forward_backward(rid, [marked], loss_fn="gspo")
    assert any(float(g.abs().sum()) > 0 for g in run.grads.values())
    engine.delete_run(rid)
