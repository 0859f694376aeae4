"""Target log-probs straight from hidden rows: the unembedding, its LoRA and the log-softmax in one pass.

The [N, V] logits never exist at once. Rows go ROW_BLOCK at a time (a [ROW_BLOCK, V] block stays in the
CPU's cache), and backward recomputes each block's logits instead of keeping them: with a 49k vocabulary and
a narrow model, moving logits through memory, not arithmetic, is what an unembedding costs on a CPU. Per
block, forward is one GEMM (+ the thin LoRA product) and one log-softmax; backward one GEMM, one softmax
and the products with W and B, over the rows with a nonzero gradient only (prompt tokens of weight 0 cost
no backward). The one-hot part of the gradient is a gather, never a [N, V] scatter. Where the caller knows
the gradient before the log-probs (a loss linear in them), forward takes it from the same blocks and
backward has nothing to recompute.

    lp[n, k] = z[n, t[n, k]] - logsumexp(z[n]),   z = h W^T + u B^T,   u = scale * h A^T
    dz[n]    = onehot(t[n]) . g[n] - softmax(z[n]) * sum_k g[n, k]
"""

from __future__ import annotations

import bisect

import torch
import torch.nn.functional as F

from whitney.engine.families.lora import Adapter
from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.modules import UNEMBED


def _row_block_cpu() -> int:
    """Rows per block on this CPU, by its vector instructions (fixed per machine, so every process on it
    blocks alike and sums alike): with AVX-512 a small block that stays in cache; with AVX2 only a taller one,
    which oneDNN's GEMM wants there (docs/BENCHMARKS.md)."""
    return 32 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 256


ROW_BLOCK_CPU = _row_block_cpu()
ROW_BLOCK_DEVICE = 1024  # an accelerator wants few, large launches ([1024, V] float32 blocks, as before)


def target_logprobs(base: BaseModel, h: torch.Tensor, targets: torch.Tensor, adapter: Adapter | None,
                    grad: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probs of the targets under the unembedding (+ the adapter's, if it adapts lm_head).

    h [N, D] hidden rows (after the final norm); targets [N] or [N, K] -> [N] or [N, K] float32.
    Differentiable in h and in the adapter's lm_head A and B.

    grad (shaped like the result): the gradient the caller's loss will send back, where it is known before
    the log-probs are (a loss linear in them: cross-entropy's is -weights). Forward then takes the gradient's
    products from each block's logits while they are in cache, and backward returns them if the gradient it
    gets is exactly `grad` (else it recomputes, as without): one GEMM and one softmax pass fewer per block.
    """
    h = h.to(base.compute_dtype)
    idx = targets[:, None] if targets.dim() == 1 else targets  # [N, K]
    known = None if grad is None else (grad[:, None] if grad.dim() == 1 else grad).float()  # [N, K]
    if adapter is not None and UNEMBED in adapter.A:
        a, b = adapter.A[UNEMBED], adapter.B[UNEMBED]  # [r, D], [V, r]
        u = (h.float() @ a.float().T) * adapter.scale  # [N, r] float32
        lp = _FusedTargetLogprobs.apply(h, u, b, idx, base, known)
    else:
        lp = _FusedTargetLogprobs.apply(h, None, None, idx, base, known)
    return lp[:, 0] if targets.dim() == 1 else lp


class _FusedTargetLogprobs(torch.autograd.Function):
    """(h [N, D], u [N, r] | None, B [V, r] | None, idx [N, K], base, known [N, K] | None) -> lp [N, K]."""

    @staticmethod
    def forward(ctx, h, u, b, idx, base, known):
        lm = _Unembedding(base, b)
        out = torch.empty(idx.shape, dtype=torch.float32, device=h.device)
        gradient = _Gradient(lm, u, idx, known) if known is not None and any(ctx.needs_input_grad[:3]) else None
        for s, e in _blocks(h):
            z = lm.logits(h[s:e], None if u is None else u[s:e])  # [R, V] float32
            if gradient is None:
                out[s:e] = torch.log_softmax(z, -1).gather(-1, idx[s:e])
            else:  # one softmax for both: the log-probs are those of its targets (one exp pass, not two)
                p = torch.softmax(z, -1)
                out[s:e] = _gathered_logs(p, z, idx[s:e])
                gradient.add_block(s, e, p)
        ctx.save_for_backward(h, u, b, idx)
        ctx.base = base
        ctx.known = None if gradient is None else (known, gradient)
        return out

    @staticmethod
    def backward(ctx, g):  # g [N, K]
        h, u, b, idx = ctx.saved_tensors
        if ctx.known is not None and torch.equal(g, ctx.known[0]):
            gradient, ctx.known = ctx.known[1], None  # taken once; a second backward recomputes
            return (*gradient.result(h, b), None, None, None)
        lm = _Unembedding(ctx.base, b)
        # Rows whose every g is 0 (prompt tokens of weight 0, above all) have no gradient: skipped.
        rows = (g != 0).any(-1).nonzero()[:, 0]  # [M]
        every = rows.numel() == h.shape[0]
        hm, um, idxm, gm = ((h, u, idx, g) if every else
                            (h[rows], None if u is None else u[rows], idx[rows], g[rows]))
        gradient = _Gradient(lm, um, idxm, gm)
        for s, e in _blocks(hm):
            gradient.add_block(s, e, torch.softmax(lm.logits(hm[s:e], None if um is None else um[s:e]), -1))
        return (*gradient.result(h, b, None if every else rows), None, None, None)


class _Gradient:
    """The gradients in h, u and B of M rows (u [M, r], targets idx [M, K]) for an incoming g [M, K], built
    from each block's softmax:

        dz[m] = onehot(t[m]) . g[m] - p[m] * c[m],   c = sum_k g[m, k]
        dh = dz W,   du = dz B,   dB^T = u^T dz

    The one-hot part is gathered at once (never a [M, V] scatter); `add_block` adds the softmax part of rows
    s:e from their softmax p [R, V], skipping rows with c = 0."""

    def __init__(self, lm: "_Unembedding", u: torch.Tensor | None, idx: torch.Tensor, g: torch.Tensor):
        self.lm, self.u = lm, u
        self.neg_c = -g.sum(-1, keepdim=True)  # [M, 1]
        self.live = (self.neg_c[:, 0] != 0).nonzero()[:, 0].tolist()  # rows with c != 0, ascending
        self.dh = torch.einsum("mk,mkd->md", g, lm.base.lm_head[idx].float())  # [M, D] float32
        self.du = self.db_t = None
        if u is not None:
            b = lm.b_t.T  # [V, r]
            self.du = torch.einsum("mk,mkr->mr", g, b[idx])  # [M, r]
            self.db_t = torch.zeros(lm.b_t.shape, dtype=torch.float32, device=u.device)  # [r, V]
            self.db_t.T.index_add_(0, idx.reshape(-1), (g[..., None] * u[:, None, :]).reshape(-1, u.shape[1]))

    def add_block(self, s: int, e: int, p: torch.Tensor) -> None:
        lo, hi = bisect.bisect_left(self.live, s), bisect.bisect_left(self.live, e)
        if lo == hi:
            return
        if hi - lo < e - s:
            rows = torch.tensor(self.live[lo:hi], device=p.device)
            p = p.index_select(0, rows - s)
        else:
            rows = slice(s, e)
        neg_c = self.neg_c[rows]
        self.dh[rows] += neg_c * self.lm.times_w(p)  # rows scaled after the product
        if self.u is not None:
            self.du[rows] += neg_c * (p @ self.lm.b_t.T)
            self.db_t.addmm_((neg_c * self.u[rows]).T, p)  # [r, R] @ [R, V]: the wide product (see lora.lora_delta)

    def result(self, h: torch.Tensor, b: torch.Tensor | None, rows: torch.Tensor | None = None):
        """(dh [N, D] in h's dtype, du [N, r], dB [V, r]) for all N rows (rows: where the M rows go)."""
        dh, du = self.dh, self.du
        if rows is not None:
            dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device).index_copy_(0, rows, dh)
            du = None if du is None else torch.zeros(h.shape[0], du.shape[1], dtype=torch.float32,
                                                     device=du.device).index_copy_(0, rows, du)
        return dh.to(h.dtype), du, None if b is None else self.db_t.T.contiguous().to(b.dtype)


class _Unembedding:
    """One block of logits, z = h W^T + u B^T in float32, and the product p W of a block's softmax (dh's):
    W and W^T through oneDNN's prepacked layouts on the CPU, in the base's dtype: faster than the plain GEMM,
    above all for p W, whose long V reduction a plain p @ W runs slowly (docs/BENCHMARKS.md)."""

    def __init__(self, base: BaseModel, b: torch.Tensor | None):
        self.base = base
        self.packed, self.packed_t = _packed_lm_head(base)
        self.b_t = None if b is None else b.detach().float().T.contiguous()  # [r, V]

    def logits(self, h: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            z = torch.ops.mkldnn._linear_pointwise(h, self.packed, None, "none", [], "").float()
        else:
            z = F.linear(h, self.base.lm_head).float()
        return z if u is None else z.addmm_(u, self.b_t)

    def times_w(self, p: torch.Tensor) -> torch.Tensor:
        """p [R, V] float32 -> p W [R, D] float32."""
        if self.packed_t is not None:
            return torch.ops.mkldnn._linear_pointwise(p.to(self.base.lm_head.dtype), self.packed_t, None, "none",
                                                      [], "").float()
        return (p.to(self.base.lm_head.dtype) @ self.base.lm_head).float()


# Below this a float32 softmax value may have lost bits to underflow (exp(z - max) < 2^-126 is subnormal).
_LOG_OF_SOFTMAX_FROM = 2.0**-100


def _gathered_logs(p: torch.Tensor, z: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """log p[r, idx[r, k]] for a block's softmax p [R, V] of its logits z [R, V]: as exact as log_softmax's
    (p is exp(z - max) / sum, each rounded once: the log is within ~1e-7 of z - max - log sum), except where
    p is so small that it underflowed; those rows take log_softmax of their logits. [R, K] float32."""
    pt = p.gather(-1, idx)
    lp = pt.log()
    tiny = (pt < _LOG_OF_SOFTMAX_FROM).any(-1).nonzero()[:, 0]
    if tiny.numel():
        lp[tiny] = torch.log_softmax(z[tiny], -1).gather(-1, idx[tiny])
    return lp


def _blocks(h: torch.Tensor):
    step = ROW_BLOCK_CPU if h.device.type == "cpu" else ROW_BLOCK_DEVICE
    for s in range(0, h.shape[0], step):
        yield s, min(s + step, h.shape[0])


def _packed_lm_head(base: BaseModel):
    """(lm_head [V, D], lm_head^T [D, V]) in oneDNN's blocked layout, built once per base model: float32 or
    bfloat16 on the CPU only (else None, None). Two more copies of lm_head in memory."""
    if base.lm_head.dtype not in (torch.float32, torch.bfloat16) or base.device.type != "cpu":
        return None, None
    if base.packed_lm_head is None:
        try:
            base.packed_lm_head = torch.ops.mkldnn._reorder_linear_weight(base.lm_head, ROW_BLOCK_CPU)
            base.packed_lm_head_t = torch.ops.mkldnn._reorder_linear_weight(base.lm_head.T.contiguous(),
                                                                            ROW_BLOCK_CPU)
        except (RuntimeError, AttributeError):
            base.packed_lm_head = base.packed_lm_head_t = False
    if base.packed_lm_head is False:
        return None, None
    return base.packed_lm_head, base.packed_lm_head_t
