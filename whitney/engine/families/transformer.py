"""The decoder forward pass (Llama, Qwen2, Qwen3) over frozen base weights plus per-row LoRA.

Written out rather than borrowed from transformers so that the adapter of every row is an argument
(`RowGroups`), not module state. Parity with the Hugging Face model is a test.

Shape legend: B rows, T positions, D hidden, H query heads, G key/value heads, E head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from whitney.engine.families import general
from whitney.engine.families.lora import RowGroups
from whitney.engine.families.model import UNEMBED, BaseModel, LayerWeights


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


def prepacked(base: BaseModel) -> dict | None:
    """Prepacked copies of a bfloat16 base's linear weights ({(layer, name) | "lm_head": packed}), for
    passes without autograd (sampling, scoring): oneDNN otherwise re-lays-out every weight on every call,
    and small-batch decode matmuls are ~40% faster packed (measured), bitwise equal. Costs one more copy
    of the linear weights, built on first use. None for float32 (its exact path), off the CPU (a CPU-only
    trick: CUDA's kernels need no re-layout) or without oneDNN."""
    if base.compute_dtype != torch.bfloat16 or base.device.type != "cpu" or torch.is_grad_enabled():
        return None
    if base.packed is None:
        try:
            pack = torch.ops.mkldnn._reorder_linear_weight
            packed = {(i, name): pack(w, 16) for i, lw in enumerate(base.layers) for name, w in lw.linear.items()}
            packed["lm_head"] = pack(base.lm_head, 16)
            base.packed = packed
        except (RuntimeError, AttributeError):
            base.packed = {}
    return base.packed or None


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_dtype(base: BaseModel) -> torch.dtype:
    """Attention runs in float32 on the CPU whatever the compute dtype: more exact, and torch's CPU kernels
    are faster in it (flash-attention backward: 17 vs 30 ms per layer at 8 x 128 tokens; decode: 260 vs
    930 us per layer at 16 rows, measured). On CUDA it runs in the compute dtype, where SDPA picks flash
    attention for bfloat16."""
    return torch.float32 if base.device.type == "cpu" else base.compute_dtype


def decoder_layer(base: BaseModel, layer: int, lw: LayerWeights, h: torch.Tensor, groups, cos: torch.Tensor,
                  sin: torch.Tensor, attend: Attend, packed: dict | None) -> torch.Tensor:
    """One decoder layer over its weights `lw`: h [B, T, D] -> [B, T, D]."""
    cfg = base.config
    B, T = h.shape[:2]
    paths = base.layer_paths[layer]

    def proj(name: str, x: torch.Tensor) -> torch.Tensor:
        y = _linear(x, lw.linear[name], lw.bias.get(name), packed and packed[(layer, name)])
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
    attn = attend(layer, q, k, v).transpose(1, 2).reshape(B, T, cfg.num_heads * cfg.head_dim)
    h = h + proj("o_proj", attn)
    x = rms_norm(h, lw.post_attn_norm, cfg.rms_eps)
    return h + proj("down_proj", F.silu(proj("gate_proj", x)) * proj("up_proj", x))


def _decoder(base: BaseModel, tokens: torch.Tensor, groups, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend) -> torch.Tensor:
    """Embed tokens [B, T], run every layer, final norm -> [B, T, D].

    `attend(layer, q [B, H, T, E], k [B, G, T, E], v [B, G, T, E])` -> [B, H, T, E] is the one part
    that differs between a full causal pass and a cached decode step. `base.layers` is a list of
    `LayerWeights`, or, for a base sharded over ranks (engine/sharded.py), a module called as
    `layers(step, h)` that runs `step(layer, weights, h)` for each layer with its weights gathered.
    """
    h = base.embed[tokens].to(base.compute_dtype)  # [B, T, D]
    packed = prepacked(base)

    def step(layer: int, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return decoder_layer(base, layer, lw, h, groups, cos, sin, attend, packed)

    if isinstance(base.layers, list):
        for layer, lw in enumerate(base.layers):
            h = step(layer, lw, h)
    else:
        h = base.layers(step, h)
    return rms_norm(h, base.final_norm, base.config.rms_eps)


def forward_hidden(base: BaseModel, tokens: torch.Tensor, groups,
                   kv_out: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, D] for right-padded tokens [B, T].

    Attention is causal, so right padding never reaches a real position: no padding mask is needed.
    With `kv_out`, each layer's keys and values [B, G, T, E] (after RoPE) are appended to it (prefill).
    """
    if base.hf is not None:  # a family of the general path: the model's own modules
        assert kv_out is None, "the general path keeps its own cache (general.step_hidden)"
        return general.forward_hidden(base, tokens, groups)
    cfg = base.config
    B, T = tokens.shape
    cos, sin = rope_tables(base, torch.arange(T, device=tokens.device)[None].expand(B, T), base.compute_dtype)
    adt = attention_dtype(base)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if kv_out is not None:
            kv_out.append((k, v))
        return F.scaled_dot_product_attention(q.to(adt), k.to(adt), v.to(adt), is_causal=True,
                                              scale=cfg.head_dim ** -0.5,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads).to(q.dtype)

    return _decoder(base, tokens, groups, cos, sin, attend)


@dataclass
class KVCache:
    """Keys and values of the active sequences: k[l], v[l] [B, G, S, E] per layer, row b valid up to
    lengths[b] (each row left-aligned at position 0). S is a capacity that grows by doubling."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor  # [B] int64

    @staticmethod
    def empty(base: BaseModel, capacity: int = 64) -> "KVCache":
        cfg = base.config
        shape = (0, cfg.num_kv_heads, capacity, cfg.head_dim)
        k = [torch.zeros(shape, dtype=base.compute_dtype, device=base.device) for _ in range(cfg.num_layers)]
        return KVCache(k, [t.clone() for t in k], torch.zeros(0, dtype=torch.int64, device=base.device))

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum())

    def grow(self, needed: int) -> None:
        """Make the capacity S at least `needed` (doubling), keeping the contents."""
        cap = self.k[0].shape[2]
        if needed <= cap:
            return
        while cap < needed:
            cap *= 2
        self.k = [F.pad(t, (0, 0, 0, cap - t.shape[2])) for t in self.k]  # [B, G, cap, E]
        self.v = [F.pad(t, (0, 0, 0, cap - t.shape[2])) for t in self.v]

    def append(self, kv: list[tuple[torch.Tensor, torch.Tensor]], lengths: torch.Tensor) -> None:
        """Add rows from a prefill: kv per layer [R, G, T, E], row r valid up to lengths[r]."""
        self.grow(int(kv[0][0].shape[2]))
        cap = self.k[0].shape[2]
        for layer, (k, v) in enumerate(kv):
            self.k[layer] = torch.cat([self.k[layer], F.pad(k, (0, 0, 0, cap - k.shape[2])).to(self.k[layer].dtype)])
            self.v[layer] = torch.cat([self.v[layer], F.pad(v, (0, 0, 0, cap - v.shape[2])).to(self.v[layer].dtype)])
        self.lengths = torch.cat([self.lengths, lengths])

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave the batch)."""
        self.k = [t[rows] for t in self.k]
        self.v = [t[rows] for t in self.v]
        self.lengths = self.lengths[rows]


def decode_hidden(base: BaseModel, tokens: torch.Tensor, groups, cache: KVCache) -> torch.Tensor:
    """One decode step: hidden [B, D] for the next token [B] of each cached row; extends the cache by one."""
    cfg = base.config
    pos = cache.lengths  # [B] position of the new token in each row
    S = int(pos.max()) + 1
    cache.grow(S)
    rows = torch.arange(tokens.shape[0], device=tokens.device)
    cos, sin = rope_tables(base, pos[:, None], base.compute_dtype)  # [B, 1, 1, E]
    mask = (torch.arange(S, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, S]
    adt = attention_dtype(base)

    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # Row b's new key and value go to slot pos[b] (an index_put: scatter_ copied the whole cache).
        cache.k[layer][rows, :, pos] = k[:, :, 0].to(cache.k[layer].dtype)  # [B, G, E]
        cache.v[layer][rows, :, pos] = v[:, :, 0].to(cache.v[layer].dtype)
        return F.scaled_dot_product_attention(q.to(adt), cache.k[layer][:, :, :S].to(adt),
                                              cache.v[layer][:, :, :S].to(adt), attn_mask=mask,
                                              scale=cfg.head_dim ** -0.5,
                                              enable_gqa=cfg.num_heads != cfg.num_kv_heads).to(q.dtype)

    hidden = _decoder(base, tokens[:, None], groups, cos, sin, attend)  # [B, 1, D]
    cache.lengths = pos + 1
    return hidden[:, 0]


def unembed(base: BaseModel, hidden: torch.Tensor, groups: RowGroups) -> torch.Tensor:
    """Logits [R, V] (float32) for hidden rows [R, D]; groups index the R rows."""
    hidden = hidden.to(base.compute_dtype)
    packed = prepacked(base)
    logits = _linear(hidden, base.lm_head, None, packed and packed["lm_head"])  # [R, V]
    return groups.apply(UNEMBED, hidden, logits).float()
