"""The fused unembedding + target log-probs (engine/unembedding.py) against float64 written here:
values and gradients in h, A and B, over several row blocks, [N] and [N, K] targets, with and without an
lm_head adapter, float32 and bfloat16 bases, with rows of zero gradient among the others, and with the
gradient known ahead (a linear loss's: taken in the forward pass) or not."""

import pytest
import torch

from whitney.engine.families.lora import init_adapter
from whitney.engine.families.model import load_base_model
from whitney.engine.families.modules import UNEMBED
from whitney.engine.losses import unembedding
from whitney.protocol.training import LoraConfig


@pytest.fixture(scope="module")
def bases(tiny_llama):
    return {dt: load_base_model(tiny_llama, compute_dtype=dt) for dt in (torch.float32, torch.bfloat16)}


def _adapter(base, seed: int, unembed: bool):
    adapter = init_adapter(base, LoraConfig(rank=4, alpha=8.0, seed=seed, train_unembed=unembed))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # B = 0 at init would leave B's path untested
        for b in adapter.B.values():
            b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return adapter


def _reference(base, h, targets, adapter):
    """float64: logits = h W^T + scale (h A^T) B^T, log_softmax, gather."""
    w = base.lm_head.double()
    h64 = h.detach().double().requires_grad_(True)
    params = {}
    logits = h64 @ w.T
    if adapter is not None and UNEMBED in adapter.A:
        params = {k: getattr(adapter, k)[UNEMBED].detach().double().requires_grad_(True) for k in ("A", "B")}
        logits = logits + adapter.scale * (h64 @ params["A"].T) @ params["B"].T
    idx = targets if targets.dim() == 2 else targets[:, None]
    lp = torch.log_softmax(logits, -1).gather(-1, idx).reshape(targets.shape)
    return lp, h64, params


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("unembed", [True, False, None])  # None: the base model alone
@pytest.mark.parametrize("k", [0, 3])  # 0: targets [N]; 3: [N, 3] with repeated candidates
@pytest.mark.parametrize("known", [False, True])  # the gradient given ahead (taken in forward) or not
def test_value_and_gradients_match_float64(bases, dtype, unembed, k, known, monkeypatch):
    base = bases[dtype]
    n = 2 * unembedding.ROW_BLOCK_CPU + 7  # three blocks, the last partial
    g = torch.Generator().manual_seed(1)
    h = (torch.randn(n, base.config.hidden_size, generator=g) * 2).to(dtype).requires_grad_(True)
    v = base.config.vocab_size
    targets = torch.randint(0, v, (n, k) if k else (n,), generator=g)
    if k:
        targets[:, 1] = targets[:, 0]  # the same candidate twice: its gradient counts twice
    adapter = None if unembed is None else _adapter(base, 3, unembed)
    weights = torch.randn(targets.shape, generator=g)
    weights[::3] = 0  # rows without gradient (weight-0 prompt tokens) skip the backward pass

    blocks = _count_logit_blocks(monkeypatch)
    lp = unembedding.target_logprobs(base, h, targets, adapter, weights if known else None)
    assert lp.shape == targets.shape and lp.dtype == torch.float32
    assert len(blocks) == 3
    params = [h] + ([adapter.A[UNEMBED], adapter.B[UNEMBED]] if unembed else [])
    grads = torch.autograd.grad((lp * weights).sum(), params)
    live = int((weights != 0).reshape(n, -1).any(-1).sum())  # backward recomputes these rows' blocks only
    recomputed = -(-live // unembedding.ROW_BLOCK_CPU)
    assert len(blocks) == 3 + (0 if known else recomputed), "a known gradient needs no second pass"

    lp64, h64, p64 = _reference(base, h, targets, adapter)
    refs = torch.autograd.grad((lp64 * weights.double()).sum(), [h64] + list(p64.values()))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lp.double(), lp64.detach(), **tol)
    for got, want in zip(grads, refs):
        assert got.dtype == (dtype if got.shape == h.shape else torch.float32)
        torch.testing.assert_close(got.double(), want, **tol)


def test_no_gradient_pass_and_a_second_backward(bases):
    """Under no_grad it only scores; with retain_graph a second backward gives the same gradient (nothing
    saved is overwritten)."""
    base = bases[torch.float32]
    adapter = _adapter(base, 5, True)
    h = torch.randn(40, base.config.hidden_size).requires_grad_(True)
    targets = torch.randint(0, base.config.vocab_size, (40,))
    with torch.no_grad():
        scored = unembedding.target_logprobs(base, h, targets, adapter)
    lp = unembedding.target_logprobs(base, h, targets, adapter)
    assert torch.equal(scored, lp.detach())
    first = torch.autograd.grad(lp.sum(), [h, adapter.B[UNEMBED]], retain_graph=True)
    second = torch.autograd.grad(lp.sum(), [h, adapter.B[UNEMBED]])
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def _count_logit_blocks(monkeypatch) -> list:
    """Every block of logits computed from now on (the GEMM over the vocabulary), one entry each."""
    calls, logits = [], unembedding._Unembedding.logits

    def counted(self, h, u):
        calls.append(h.shape[0])
        return logits(self, h, u)

    monkeypatch.setattr(unembedding._Unembedding, "logits", counted)
    return calls


def test_a_gradient_other_than_the_known_one_is_recomputed(bases, monkeypatch):
    """The known gradient is a promise the loss makes; if backward gets another one, it recomputes: the
    gradients are those of the gradient actually sent, and a second backward (retain_graph) recomputes too."""
    base = bases[torch.float32]
    adapter = _adapter(base, 6, True)
    n = unembedding.ROW_BLOCK_CPU + 5
    h = torch.randn(n, base.config.hidden_size).requires_grad_(True)
    targets = torch.randint(0, base.config.vocab_size, (n,))
    weights = torch.randn(n)
    blocks = _count_logit_blocks(monkeypatch)
    lp = unembedding.target_logprobs(base, h, targets, adapter, weights)
    params = [h, adapter.A[UNEMBED], adapter.B[UNEMBED]]
    other = torch.autograd.grad((lp * 2 * weights).sum(), params, retain_graph=True)
    assert len(blocks) == 4, "2 blocks forward, 2 recomputed for the other gradient"
    taken = torch.autograd.grad((lp * weights).sum(), params, retain_graph=True)
    again = torch.autograd.grad((lp * weights).sum(), params)
    assert len(blocks) == 4 + 2, "the known gradient taken once, without a pass; the second backward recomputes"
    lp64, h64, p64 = _reference(base, h, targets, adapter)
    for scale, grads in ((2, other), (1, taken), (1, again)):
        refs = torch.autograd.grad((lp64 * scale * weights.double()).sum(), [h64, *p64.values()], retain_graph=True)
        for got, want in zip(grads, refs):
            torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_log_probs_far_below_a_float32_softmax_come_from_log_softmax(bases):
    """With the gradient known, the log-probs are the logs of the softmax the gradient needs; a target so
    unlikely that its softmax underflows float32 (log-prob far below -87) still gets its exact log-prob
    (those rows take log_softmax), and the gradient is finite and float64's."""
    base = bases[torch.float32]
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(40, base.config.hidden_size, generator=g) * 60).requires_grad_(True)
    targets = torch.randint(0, base.config.vocab_size, (40,), generator=g)
    weights = torch.randn(40, generator=g)
    lp = unembedding.target_logprobs(base, h, targets, None, weights)
    (dh,) = torch.autograd.grad((lp * weights).sum(), [h])
    lp64, h64, _ = _reference(base, h, targets, None)
    (want,) = torch.autograd.grad((lp64 * weights.double()).sum(), [h64])
    assert float(lp64.detach().min()) < -200 and float(lp64.detach().max()) > -60, "both kinds of rows are there"
    torch.testing.assert_close(lp.double(), lp64.detach(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(dh.double(), want, rtol=1e-5, atol=1e-5)
