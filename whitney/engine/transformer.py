"""The decoder forward pass (Llama, Qwen2, Qwen3) over frozen base weights plus per-row LoRA.

Written out rather than borrowed from transformers so that the adapter of every row is an argument
(`RowGroups`), not module state. Parity with the Hugging Face model is a test.

Shape legend: B rows, T positions, D hidden, H query heads, G key/value heads, E head dim, V vocab.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from whitney.engine.lora import RowGroups
from whitney.engine.model import BaseModel, LAYER_PROJECTIONS, UNEMBED, module_path


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, normalised in float32 as Hugging Face does. x [..., D]."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x32.to(dtype)


def rope_tables(base: BaseModel, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, 1, T, E] for integer positions [B, T]."""
    freqs = positions[..., None].float() * base.inv_freq  # [B, T, E/2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [B, T, E]
    cos = (emb.cos() * base.rope_scaling).to(dtype)[:, None]
    sin = (emb.sin() * base.rope_scaling).to(dtype)[:, None]
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, E] by the position tables (rotate-half convention)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _paths(base: BaseModel) -> list[dict[str, str]]:
    return [{p: module_path(i, p) for p in LAYER_PROJECTIONS} for i in range(base.config.num_layers)]


def forward_hidden(base: BaseModel, tokens: torch.Tensor, groups: RowGroups,
                   positions: torch.Tensor | None = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, D] for right-padded tokens [B, T].

    Attention is causal, so right padding never reaches a real position: no padding mask is needed.
    """
    cfg = base.config
    B, T = tokens.shape
    dt = base.compute_dtype
    if positions is None:
        positions = torch.arange(T)[None].expand(B, T)
    cos, sin = rope_tables(base, positions, dt)
    h = base.embed[tokens].to(dt)  # [B, T, D]
    for lw, paths in zip(base.layers, _paths(base)):

        def proj(name: str, x: torch.Tensor) -> torch.Tensor:
            y = F.linear(x, lw.linear[name].to(dt), lw.bias[name].to(dt) if name in lw.bias else None)
            return groups.apply(paths[name], x, y)

        x = rms_norm(h, lw.input_norm, cfg.rms_eps)
        q = proj("q_proj", x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = proj("k_proj", x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = proj("v_proj", x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q = rms_norm(q, lw.q_norm, cfg.rms_eps)
            k = rms_norm(k, lw.k_norm, cfg.rms_eps)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, H|G, T, E]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.head_dim ** -0.5,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads)  # [B, H, T, E]
        attn = attn.transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)
        h = h + proj("o_proj", attn)
        x = rms_norm(h, lw.post_attn_norm, cfg.rms_eps)
        h = h + proj("down_proj", F.silu(proj("gate_proj", x)) * proj("up_proj", x))
    return rms_norm(h, base.final_norm, cfg.rms_eps)


def unembed(base: BaseModel, hidden: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """Logits [R, V] (float32) for hidden rows [R, D]; groups index the R rows."""
    dt = base.compute_dtype
    hidden = hidden.to(dt)
    logits = hidden @ base.lm_head.to(dt).T
    return groups.apply(UNEMBED, hidden, logits).float()
