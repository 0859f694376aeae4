"""The fast families (Llama, Qwen2, Qwen3): the decoder written out over the frozen base weights plus per-row LoRA.

Written out rather than borrowed from transformers so that the adapter of every row is an argument
(`RowGroups`), not module state. Parity with the Hugging Face model is a test. `TransformerModel` is this
family's `BaseModel` (decoder.py); `load_transformer` builds one from a loaded Hugging Face model. Its sampling
keeps a `KVCache`: every row's keys and values in one ragged batch.

Shape legend: B rows, T positions, D hidden, H query heads, G key/value heads, E head dim, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from whitney.engine.families.decoder import BaseModel, DecodeCache, ModelConfig, linear, prepacked
from whitney.engine.families.lora import RowGroups
from whitney.engine.families.modules import LAYER_PROJECTIONS, module_path
from whitney.engine.families.vision import ProcessedImage


@dataclass
class LayerWeights:
    """Frozen weights of one decoder layer. Linear weights are [out, in] as in nn.Linear."""

    input_norm: torch.Tensor  # [D]
    post_attn_norm: torch.Tensor  # [D]
    linear: dict[str, torch.Tensor]  # projection name -> [out, in]
    bias: dict[str, torch.Tensor]  # projection name -> [out] (Qwen2 q/k/v only)
    q_norm: torch.Tensor | None  # [head_dim]
    k_norm: torch.Tensor | None  # [head_dim]


# One decoder layer's step over its weights: step(layer, weights, h [B, T, D]) -> [B, T, D].
LayerStep = Callable[[int, LayerWeights, torch.Tensor], torch.Tensor]
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) * weight, normalised in float32 as Hugging Face does. x [..., D]."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight.to(dtype) * x32.to(dtype)


def rope_tables(base: TransformerModel, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
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


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def attention_dtype(base: BaseModel) -> torch.dtype:
    """Attention runs in float32 on the CPU whatever the compute dtype: more exact, and torch's CPU kernels
    are faster in it than in bfloat16, forward and backward. On CUDA it runs in the compute dtype, where SDPA
    picks flash attention for bfloat16."""
    return torch.float32 if base.device.type == "cpu" else base.compute_dtype


def decoder_layer(base: TransformerModel, layer: int, lw: LayerWeights, h: torch.Tensor, groups, cos: torch.Tensor,
                  sin: torch.Tensor, attend: Attend, packed: dict | None) -> torch.Tensor:
    """One decoder layer over its weights `lw`: h [B, T, D] -> [B, T, D]."""
    cfg = base.config
    B, T = h.shape[:2]
    paths = base.layer_paths[layer]

    def proj(name: str, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, lw.linear[name], lw.bias.get(name), packed and packed[(layer, name)])
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


def _decoder(base: TransformerModel, tokens: torch.Tensor, groups, cos: torch.Tensor, sin: torch.Tensor,
             attend: Attend) -> torch.Tensor:
    """Embed tokens [B, T], run every layer, final norm -> [B, T, D].

    `attend(layer, q [B, H, T, E], k [B, G, T, E], v [B, G, T, E])` -> [B, H, T, E] is the one part
    that differs between a full causal pass and a cached decode step.
    """
    h = base.embed[tokens].to(base.compute_dtype)  # [B, T, D]
    packed = prepacked(base)

    def step(layer: int, lw: LayerWeights, h: torch.Tensor) -> torch.Tensor:
        return decoder_layer(base, layer, lw, h, groups, cos, sin, attend, packed)

    h = base.run_layers(step, h)
    return rms_norm(h, base.final_norm, base.config.rms_eps)


@dataclass(kw_only=True)
class TransformerModel(BaseModel):
    """A base model of a fast family: its decoder layers' frozen weights, run by this module's decoder."""

    decode_cache = DecodeCache.KV
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [D]
    inv_freq: torch.Tensor  # [head_dim / 2] RoPE inverse frequencies
    rope_scaling: float  # post-processing factor on cos/sin (1.0 for default RoPE)
    # per layer: projection name -> its module path (the key of its LoRA weights)
    layer_paths: list[dict[str, str]] = field(default_factory=list)

    def run_layers(self, step: LayerStep, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, D] through every layer: step(layer, weights, h) for each in order (a sharded model gathers
        each layer's weights first: training/sharded.py)."""
        for layer, lw in enumerate(self.layers):
            h = step(layer, lw, h)
        return h

    def packable_weights(self) -> Iterator[tuple[object, torch.Tensor]]:
        yield from super().packable_weights()
        for i, lw in enumerate(self.layers):
            for name, w in lw.linear.items():
                yield (i, name), w

    def module_paths(self) -> list[str]:
        return list(self.linear_shapes)  # every nn.Linear of the checkpoint: no other module has their names

    def shard(self, shard: Callable[[nn.Module], None], device: torch.device) -> ShardedTransformerModel:
        """This model (loaded on the CPU) with its decoder layers as modules sharded by `shard` (each layer's,
        then their root's) and the rest (embedding, final norm, unembedding) on `device`. Takes the layers'
        weights over: once a shard is copied, nothing references the whole weight, so it is freed."""
        root = LayerStack(self.layers)
        self.layers = []
        for module in root.layers:
            shard(module)
        shard(root)
        tied = self.lm_head.data_ptr() == self.embed.data_ptr()
        embed = self.embed.to(device)
        # packed={}: no oneDNN-prepacked copies (they would be whole copies of every layer's weights).
        return ShardedTransformerModel(**{f.name: getattr(self, f.name) for f in fields(self)} | dict(
            embed=embed, layers=root, final_norm=self.final_norm.to(device),
            lm_head=embed if tied else self.lm_head.to(device), inv_freq=self.inv_freq.to(device), packed={}))

    def forward_hidden(self, tokens: torch.Tensor, groups: RowGroups,
                       images: list[list[ProcessedImage]] | None = None,
                       kv_out: list[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] for right-padded tokens [B, T] (these families take no images).

        Attention is causal, so right padding never reaches a real position: no padding mask is needed.
        With `kv_out`, each layer's keys and values [B, G, T, E] (after RoPE) are appended to it (prefill).
        """
        assert not images or not any(images), f"{self.config.model_type} takes no images (its expander refuses them)"
        cfg = self.config
        B, T = tokens.shape
        cos, sin = rope_tables(self, torch.arange(T, device=tokens.device)[None].expand(B, T), self.compute_dtype)
        adt = attention_dtype(self)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if kv_out is not None:
                kv_out.append((k, v))
            return F.scaled_dot_product_attention(q.to(adt), k.to(adt), v.to(adt), is_causal=True,
                                                  scale=cfg.head_dim ** -0.5,
                                                  enable_gqa=cfg.num_heads != cfg.num_kv_heads).to(q.dtype)

        return _decoder(self, tokens, groups, cos, sin, attend)

    def decode_hidden(self, tokens: torch.Tensor, groups: RowGroups, cache: KVCache) -> torch.Tensor:
        """One decode step: hidden [B, D] for the next token [B] of each cached row; extends the cache by one."""
        cfg = self.config
        pos = cache.lengths  # [B] position of the new token in each row
        S = int(pos.max()) + 1
        cache.grow(S)
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        cos, sin = rope_tables(self, pos[:, None], self.compute_dtype)  # [B, 1, 1, E]
        mask = (torch.arange(S, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]  # [B, 1, 1, S]
        adt = attention_dtype(self)

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            # Row b's new key and value go to slot pos[b] (an index_put: scatter_ copied the whole cache).
            cache.k[layer][rows, :, pos] = k[:, :, 0].to(cache.k[layer].dtype)  # [B, G, E]
            cache.v[layer][rows, :, pos] = v[:, :, 0].to(cache.v[layer].dtype)
            return F.scaled_dot_product_attention(q.to(adt), cache.k[layer][:, :, :S].to(adt),
                                                  cache.v[layer][:, :, :S].to(adt), attn_mask=mask,
                                                  scale=cfg.head_dim ** -0.5,
                                                  enable_gqa=cfg.num_heads != cfg.num_kv_heads).to(q.dtype)

        hidden = _decoder(self, tokens[:, None], groups, cos, sin, attend)  # [B, 1, D]
        cache.lengths = pos + 1
        return hidden[:, 0]


class _LayerModule(nn.Module):
    """One decoder layer's frozen weights as parameters without gradients, for a sharding wrapper (FSDP2) to
    shard and gather."""

    def __init__(self, lw: LayerWeights):
        super().__init__()

        def frozen(t: torch.Tensor) -> nn.Parameter:
            return nn.Parameter(t, requires_grad=False)

        self.input_norm = frozen(lw.input_norm)  # [D]
        self.post_attn_norm = frozen(lw.post_attn_norm)  # [D]
        self.linear = nn.ParameterDict({k: frozen(w) for k, w in lw.linear.items()})  # [out, in]
        self.bias = nn.ParameterDict({k: frozen(b) for k, b in lw.bias.items()})  # [out]
        self.q_norm = None if lw.q_norm is None else frozen(lw.q_norm)  # [head_dim]
        self.k_norm = None if lw.k_norm is None else frozen(lw.k_norm)

    def forward(self, step: LayerStep, layer: int, h: torch.Tensor) -> torch.Tensor:
        """step(layer, weights, h [B, T, D]) over this layer's whole weights (its wrapper gathered them)."""
        weights = LayerWeights(self.input_norm, self.post_attn_norm, dict(self.linear.items()),
                               dict(self.bias.items()), self.q_norm, self.k_norm)
        return step(layer, weights, h)


def layer_checkpoint_keys(layer: int) -> dict[str, str]:
    """Each parameter of layer `layer`'s `_LayerModule` -> its tensor's name in the checkpoint."""
    prefix = f"model.layers.{layer}."
    keys = {"input_norm": prefix + "input_layernorm.weight",
            "post_attn_norm": prefix + "post_attention_layernorm.weight",
            "q_norm": prefix + "self_attn.q_norm.weight", "k_norm": prefix + "self_attn.k_norm.weight"}
    for projection, path in LAYER_PROJECTIONS.items():
        keys[f"linear.{projection}"] = prefix + path + ".weight"
        keys[f"bias.{projection}"] = prefix + path + ".bias"
    return keys


class LayerStack(nn.Module):
    """Every layer as a module, each run through its own `__call__` so that its wrapper's hooks fire around it."""

    def __init__(self, layers: list[LayerWeights]):
        super().__init__()
        self.layers = nn.ModuleList(_LayerModule(lw) for lw in layers)

    def forward(self, step: LayerStep, h: torch.Tensor) -> torch.Tensor:
        for layer, module in enumerate(self.layers):
            h = module(step, layer, h)
        return h


@dataclass(kw_only=True)
class ShardedTransformerModel(TransformerModel):
    """A TransformerModel whose decoder layers are a module sharded over the ranks of a process group
    (training/sharded.py): each layer's weights are gathered for its forward and again for its backward."""

    layers: LayerStack  # type: ignore[assignment]

    def run_layers(self, step: LayerStep, h: torch.Tensor) -> torch.Tensor:
        return self.layers(step, h)


@dataclass
class KVCache:
    """Keys and values of the active sequences: k[l], v[l] [B, G, S, E] per layer, row b valid up to
    lengths[b] (each row left-aligned at position 0). S is a capacity that grows by doubling."""

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor  # [B] int64

    @staticmethod
    def empty(base: TransformerModel, capacity: int = 64) -> KVCache:
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


def load_transformer(name: str, path: Path, hf: torch.nn.Module, tokenizer, compute_dtype: torch.dtype,
                     device: torch.device | str) -> TransformerModel:
    """A TransformerModel over the weights of the Hugging Face model `hf` (read in float32 on the CPU), stored in
    `compute_dtype` on `device`; the Hugging Face module itself is not kept."""
    cfg = hf.config
    rotary = hf.model.rotary_emb
    inv_freq = rotary.inv_freq.detach().float().clone().to(device)  # before any cast: RoPE tables stay exact
    # Frozen weights in the compute dtype on the device (ties kept); a no-op for float32 on the CPU. Layer weights
    # on the meta device (loaded rank-locally after sharding, rank_local.py) stay there, and so does the rest.
    hf.to(dtype=compute_dtype)
    if not any(p.is_meta for p in hf.parameters()):
        hf.to(device=device)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    config = ModelConfig(
        model_type=cfg.model_type,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=cfg.num_attention_heads,
        num_kv_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        intermediate_size=cfg.intermediate_size,
        rms_eps=cfg.rms_norm_eps,
        max_context=cfg.max_position_embeddings,
        tie_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        qk_norm=cfg.model_type == "qwen3",
        attention_bias=cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
    )
    layers = []
    for layer in hf.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        mods = {"q_proj": attn.q_proj, "k_proj": attn.k_proj, "v_proj": attn.v_proj, "o_proj": attn.o_proj,
                "gate_proj": mlp.gate_proj, "up_proj": mlp.up_proj, "down_proj": mlp.down_proj}
        layers.append(LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            post_attn_norm=layer.post_attention_layernorm.weight.detach(),
            linear={k: m.weight.detach() for k, m in mods.items()},
            bias={k: m.bias.detach() for k, m in mods.items() if m.bias is not None},
            q_norm=attn.q_norm.weight.detach() if config.qk_norm else None,
            k_norm=attn.k_norm.weight.detach() if config.qk_norm else None,
        ))
    linear_shapes = {
        name: (m.in_features, m.out_features)
        for name, m in hf.named_modules()
        if isinstance(m, torch.nn.Linear)
    }
    eos = cfg.eos_token_id if cfg.eos_token_id is not None else tokenizer.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    for p in hf.parameters():
        p.requires_grad_(False)
    return TransformerModel(
        name=name,
        path=path,
        config=config,
        embed=hf.model.embed_tokens.weight.detach(),
        layers=layers,
        final_norm=hf.model.norm.weight.detach(),
        lm_head=hf.lm_head.weight.detach(),
        inv_freq=inv_freq,
        rope_scaling=float(rotary.attention_scaling),
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        compute_dtype=compute_dtype,
        linear_shapes=linear_shapes,
        layer_paths=[{p: module_path(i, p) for p in LAYER_PROJECTIONS} for i in range(config.num_layers)],
    )
