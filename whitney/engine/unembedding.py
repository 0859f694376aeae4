"""Target log-probs straight from hidden rows: the unembedding, its LoRA and the log-softmax in one pass.

The [N, V] logits never exist at once. Rows go ROW_BLOCK at a time (a [ROW_BLOCK, V] block stays in the
CPU's cache), and backward recomputes each block's logits instead of keeping them: with a 49k vocabulary and
a narrow model, moving logits through memory, not arithmetic, is what an unembedding costs on a CPU. Per
block, forward is one GEMM (+ the thin LoRA product) and one log-softmax; backward one GEMM, one softmax
and the products with W and B, over the rows with a nonzero gradient only (prompt tokens of weight 0 cost
no backward). The one-hot part of the gradient is a gather, never a [N, V] scatter.

    lp[n, k] = z[n, t[n, k]] - logsumexp(z[n]),   z = h W^T + u B^T,   u = scale * h A^T
    dz[n]    = onehot(t[n]) . g[n] - softmax(z[n]) * sum_k g[n, k]
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from whitney.engine.lora import Adapter
from whitney.engine.model import UNEMBED, BaseModel

ROW_BLOCK_CPU = 32  # measured on a 2-core CPU, vocab 49,152: 16-64 within 10%, 256 2x slower (out of cache)
ROW_BLOCK_DEVICE = 1024  # an accelerator wants few, large launches ([1024, V] float32 blocks, as before)


def target_logprobs(base: BaseModel, h: torch.Tensor, targets: torch.Tensor,
                    adapter: Adapter | None) -> torch.Tensor:
    """Log-probs of the targets under the unembedding (+ the adapter's, if it adapts lm_head).

    h [N, D] hidden rows (after the final norm); targets [N] or [N, K] -> [N] or [N, K] float32.
    Differentiable in h and in the adapter's lm_head A and B.
    """
    h = h.to(base.compute_dtype)
    idx = targets[:, None] if targets.dim() == 1 else targets  # [N, K]
    if adapter is not None and UNEMBED in adapter.A:
        a, b = adapter.A[UNEMBED], adapter.B[UNEMBED]  # [r, D], [V, r]
        u = (h.float() @ a.float().T) * adapter.scale  # [N, r] float32
        lp = _FusedTargetLogprobs.apply(h, u, b, idx, base)
    else:
        lp = _FusedTargetLogprobs.apply(h, None, None, idx, base)
    return lp[:, 0] if targets.dim() == 1 else lp


class _FusedTargetLogprobs(torch.autograd.Function):
    """(h [N, D], u [N, r] | None, B [V, r] | None, idx [N, K], base) -> lp [N, K] float32."""

    @staticmethod
    def forward(ctx, h, u, b, idx, base):
        lm = _Unembedding(base, b)
        out = torch.empty(idx.shape, dtype=torch.float32, device=h.device)
        for s, e in _blocks(h):
            z = lm.logits(h[s:e], None if u is None else u[s:e])  # [R, V] float32
            out[s:e] = torch.log_softmax(z, -1).gather(-1, idx[s:e])
        ctx.save_for_backward(h, u, b, idx)
        ctx.base = base
        return out

    @staticmethod
    def backward(ctx, g):  # g [N, K]
        h, u, b, idx = ctx.saved_tensors
        lm = _Unembedding(ctx.base, b)
        w = ctx.base.lm_head
        dh = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        du = None if u is None else torch.zeros_like(u)
        db_t = None if b is None else torch.zeros(b.shape[1], b.shape[0], dtype=torch.float32, device=b.device)
        # Rows whose every g is 0 (prompt tokens of weight 0, above all) have no gradient: skipped.
        rows = (g != 0).any(-1).nonzero()[:, 0]  # [M]
        if rows.numel() < h.shape[0]:
            h, g, idx, u = h[rows], g[rows], idx[rows], None if u is None else u[rows]
        c = g.sum(-1, keepdim=True)  # [M, 1]: the softmax part of each row's gradient is -c * p
        # The one-hot part: dh = sum_k g[k] W[t_k], du = sum_k g[k] B[t_k], dB[t_k] += g[k] u.
        dh_m = torch.einsum("mk,mkd->md", g, w[idx].float())  # [M, D] float32
        du_m = None
        if b is not None:
            du_m = torch.einsum("mk,mkr->mr", g, b[idx].float())  # [M, r]
            db_t.T.index_add_(0, idx.reshape(-1), (g[..., None] * u[:, None, :]).reshape(-1, u.shape[1]))
        for s, e in _blocks(h):
            p = torch.softmax(lm.logits(h[s:e], None if u is None else u[s:e]), -1)  # [R, V] float32
            neg_c = -c[s:e]
            dh_m[s:e] += neg_c * (p.to(w.dtype) @ w).float()  # rows scaled after the product: no [R, V] pass
            if b is not None:
                du_m[s:e] += neg_c * (p @ lm.b_t.T)
                db_t.addmm_((neg_c * u[s:e]).T, p)  # [r, R] @ [R, V]: the wide product (see lora._delta)
        dh[rows] = dh_m
        if du is not None:
            du[rows] = du_m
        return (dh.to(h.dtype), du, None if b is None else db_t.T.contiguous().to(b.dtype), None, None)


class _Unembedding:
    """One block of logits, z = h W^T + u B^T in float32: W through oneDNN's prepacked layout on the CPU
    in float32 (1.4-1.8x faster than the plain GEMM for a [32, 64] x [64, 49152] block, measured)."""

    def __init__(self, base: BaseModel, b: torch.Tensor | None):
        self.base = base
        self.packed = _packed_lm_head(base)
        self.b_t = None if b is None else b.detach().float().T.contiguous()  # [r, V]

    def logits(self, h: torch.Tensor, u: torch.Tensor | None) -> torch.Tensor:
        if self.packed is not None:
            z = torch.ops.mkldnn._linear_pointwise(h, self.packed, None, "none", [], "")
        else:
            z = F.linear(h, self.base.lm_head).float()
        return z if u is None else z.addmm_(u, self.b_t)


def _blocks(h: torch.Tensor):
    step = ROW_BLOCK_CPU if h.device.type == "cpu" else ROW_BLOCK_DEVICE
    for s in range(0, h.shape[0], step):
        yield s, min(s + step, h.shape[0])


def _packed_lm_head(base: BaseModel):
    """lm_head in oneDNN's blocked layout, built once per base model: float32 on the CPU only."""
    if base.lm_head.dtype != torch.float32 or base.device.type != "cpu":
        return None
    if base.packed_lm_head is None:
        try:
            base.packed_lm_head = torch.ops.mkldnn._reorder_linear_weight(base.lm_head, ROW_BLOCK_CPU)
        except (RuntimeError, AttributeError):
            base.packed_lm_head = False
    return None if base.packed_lm_head is False else base.packed_lm_head
