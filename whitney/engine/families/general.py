"""The general path: any decoder-only Hugging Face causal LM, run through its own modules.

Llama, Qwen2 and Qwen3 take the hand-written decoder (transformer.py, the fast path). Every other
family takes this path: its `GeneralModel` (decoder.py's interface) keeps the frozen Hugging Face module
(`GeneralModel.hf`) and a pass runs the model's own decoder, with the per-row LoRA deltas added at each adapted
nn.Linear by forward hooks that live for that one pass only (`adapted`), and at each adapted stacked-experts module of
a MoE layer by its forward swapped for that pass (experts.py). Both read the pass's `RowGroups` (data,
an argument), never a "current adapter": nothing of a run stays on the shared module. Two passes
must not overlap on one base model (they would see each other's hooks): the Engine is driven by one
thread, and each Ray worker holds its own copy of the model.

A model is admitted only after two checks on a few tokens at load (`_self_check`): its logits are
`lm_head(final hidden)` with nothing more (Gemma 2's soft-capping, Granite's logit scaling, a biased
head are refused, since runs.py unembeds with `base.lm_head` itself; Gemma 3 has no soft-cap), and a row
right-padded equals the row alone (causal, no mask needed; an encoder or bidirectional model is refused).

A pass with image rows (a vision-language checkpoint, vision.py) runs the checkpoint's inner multimodal module
instead, whose language model is this decoder, with the same hooks. Sampling keeps the model's own cache
(sampling/hf_sampler.py), a step of which is `step_hidden`.

Shape legend: B rows, T positions, D hidden, V vocabulary.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import Callable

import torch

from whitney.engine.families.decoder import BaseModel, DecodeCache, ModelConfig
from whitney.engine.families.experts import adapted_experts, expert_projections
from whitney.engine.families.lora import RowGroups
from whitney.engine.families.modules import UNEMBED
from whitney.engine.families.vision import ProcessedImage, load_vision, model_inputs
from whitney.errors import InvalidInput
from whitney.protocol.config import shown_name

# Families whose general path is tested against Hugging Face and PEFT (tests/engine/test_general_path.py,
# test_general_moe.py), then the multimodal checkpoints served as their text model there.
TESTED_TYPES = ("mistral", "olmo2", "phi3", "smollm3", "qwen3_5_text", "qwen3_moe", "qwen3_5_moe_text",
                "gemma3_text", "gpt_oss", "qwen3_5", "qwen3_5_moe", "gemma3")
# Config fields that put something between the final hidden state and lm_head, or scale it.
_UNEMBED_EXTRAS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")
SELF_CHECK_ATOL = 1e-4


def _refuse(name: str, why: str) -> InvalidInput:
    return InvalidInput(f"base model {shown_name(name)!r} cannot be served: {why}", field="base_model")


def decoder_of(hf: torch.nn.Module) -> tuple[str, torch.nn.Module]:
    """The decoder stack (embeddings, layers, final norm) of a causal LM and its module path."""
    decoder = hf.get_decoder() if hasattr(hf, "get_decoder") else getattr(hf, "model", None)
    for path, module in hf.named_modules():
        if module is decoder and path:
            return path, module
    raise ValueError("it has no decoder module")


def adaptable_shapes(hf: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """What LoRA may adapt, in the model's module order, then `lm_head`: every nn.Linear inside the decoder
    layers by module path -> (in, out), and every stacked expert projection of a MoE layer by parameter
    path (`...mlp.experts.gate_up_proj`) -> (in, out, E)."""
    path, decoder = decoder_of(hf)
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise ValueError("its decoder has no `layers` list")
    out = {}
    for name, m in layers.named_modules():
        if isinstance(m, torch.nn.Linear):
            out[f"{path}.layers.{name}"] = (m.in_features, m.out_features)
        for param, shape in expert_projections(m).items():
            out[f"{path}.layers.{name}.{param}"] = shape
    head = hf.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head is not getattr(hf, UNEMBED, None):
        raise ValueError("its output embedding is not an nn.Linear named lm_head")
    if head.bias is not None:
        raise ValueError("its lm_head has a bias")
    out[UNEMBED] = (head.in_features, head.out_features)
    return out


def _self_check(hf: torch.nn.Module, decoder: torch.nn.Module, vocab: int) -> str | None:
    """Why this model's logits are not `lm_head(hidden)` of a causal pass without a mask, or None."""
    g = torch.Generator(device="cpu").manual_seed(0)
    row = torch.randint(0, vocab, (1, 5), generator=g, device="cpu")
    padded = torch.cat([row, torch.randint(0, vocab, (1, 3), generator=g, device="cpu")], dim=1)  # right padding
    with torch.no_grad():
        logits = hf(input_ids=row, use_cache=False).logits.float()  # [1, 5, V]
        hidden = decoder(input_ids=row, use_cache=False).last_hidden_state  # [1, 5, D]
        ours = hf.get_output_embeddings()(hidden).float()
        alone = hidden
        in_batch = decoder(input_ids=padded, use_cache=False).last_hidden_state[:, :5]
    if not torch.allclose(ours, logits, atol=SELF_CHECK_ATOL, rtol=0):
        return "its logits are not lm_head(final hidden state) (a soft-cap, scale or other extra in its head)"
    if not torch.allclose(alone, in_batch, atol=SELF_CHECK_ATOL, rtol=0):
        return "right padding changes real positions (not a causal decoder-only model)"
    return None


def admit(name: str, hf: torch.nn.Module) -> None:
    """Refuse (InvalidInput naming `base_model`) a model this path cannot serve: an encoder-decoder, a head that
    transforms its logits, no decoder `layers` list or no nn.Linear lm_head, no max_position_embeddings, or one that
    fails `_self_check`'s forwards (read in float32 on the CPU). Its weights are frozen and it is put in eval mode."""
    cfg = hf.config
    text = cfg.get_text_config()  # the text model's config (itself, unless a multimodal checkpoint: gemma3)
    if getattr(cfg, "is_encoder_decoder", False):
        raise _refuse(name, f"model type {cfg.model_type!r} is an encoder-decoder, not a decoder-only causal LM")
    extras = [k for k in _UNEMBED_EXTRAS if getattr(text, k, None) not in (None, 1, 1.0)]
    if extras:
        raise _refuse(name, f"model type {cfg.model_type!r} transforms its logits ({', '.join(extras)}), "
                            "which this server's unembedding does not reproduce")
    try:
        _, decoder = decoder_of(hf)
        adaptable_shapes(hf)
    except ValueError as e:
        raise _refuse(name, f"model type {cfg.model_type!r}: {e}") from None
    context = getattr(text, "max_position_embeddings", None)
    if not isinstance(context, int) or context < 2:
        raise _refuse(name, "its config has no max_position_embeddings")
    for p in hf.parameters():
        p.requires_grad_(False)
    hf.eval()
    try:
        why = _self_check(hf, decoder, text.vocab_size)
    except Exception as e:  # the model's own forward failed on five tokens: it cannot be served
        why = f"its forward failed ({type(e).__name__}: {e})"
    if why:
        raise _refuse(name, f"model type {cfg.model_type!r}: {why}")


def load_general(name: str, path: Path, hf: torch.nn.Module, tokenizer, compute_dtype: torch.dtype,
                 device: torch.device | str | None, admitted: bool = False) -> GeneralModel:
    """A GeneralModel over the frozen Hugging Face module `hf` (read in float32 on the CPU): checked (`admit`,
    unless `admitted`: the caller ran it), frozen, then moved to `device` (None: where it is) in `compute_dtype`."""
    if not admitted:
        admit(name, hf)
    cfg = hf.config
    text = cfg.get_text_config()
    decoder_path, _ = decoder_of(hf)
    shapes = adaptable_shapes(hf)
    hf.to(device=device, dtype=compute_dtype)
    vision = load_vision(path, hf, compute_dtype, device)  # None: served as text only
    heads = getattr(text, "num_attention_heads", 0) or 0
    config = ModelConfig(
        model_type=cfg.model_type,
        vocab_size=text.vocab_size,
        hidden_size=text.hidden_size,
        num_layers=text.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or (text.hidden_size // heads if heads else 0),
        intermediate_size=getattr(text, "intermediate_size", 0) or 0,
        rms_eps=float(getattr(text, "rms_norm_eps", 0.0) or 0.0),
        max_context=text.max_position_embeddings,
        tie_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        qk_norm=False,  # fast-path fields: the model's own modules do what its family does
        attention_bias=False,
    )
    eos = next((e for e in (getattr(cfg, "eos_token_id", None), getattr(text, "eos_token_id", None),
                            tokenizer.eos_token_id) if e is not None), None)
    eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
    return GeneralModel(
        name=name,
        path=path,
        config=config,
        embed=hf.get_input_embeddings().weight.detach(),
        lm_head=hf.get_output_embeddings().weight.detach(),
        tokenizer=tokenizer,
        eos_token_ids=eos_ids,
        compute_dtype=compute_dtype,
        linear_shapes=shapes,
        hf=hf,
        hf_decoder=decoder_path,
        vision=vision,
    )


def _apply(groups: RowGroups, rows: int, path: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """`groups.apply` at one linear of a pass over B = `rows` rows: x [B, T, in] -> y [B, T, out], or the
    tokens flattened row-major, x [B*T, in] (a MoE block's shared expert and its gate)."""
    if x.shape[0] == rows or x.dim() > 2:
        return groups.apply(path, x, y)
    return groups.apply(path, x.reshape(rows, -1, x.shape[-1]), y.reshape(rows, -1, y.shape[-1])).reshape(y.shape)


def _batch_rows(rows: list[int], _module, args: tuple, kwargs: dict) -> None:
    """A forward pre-hook on the decoder: records the pass's B from its input_ids [B, T] (or embeddings)."""
    first = kwargs.get("input_ids", args[0] if args else None)
    rows[:] = [(first if first is not None else kwargs["inputs_embeds"]).shape[0]]


@contextmanager
def adapted(base: GeneralModel, groups: RowGroups):
    """For one pass of the decoder: forward hooks adding the groups' deltas at every decoder linear some
    group's adapter adapts, and the experts modules whose projections it adapts computing with the deltas
    (experts.adapted_experts); all removed on exit (also on an exception). lm_head is never hooked:
    the unembedding (BaseModel.unembed, losses/unembedding.py) uses the weight. Tokens flattened by a MoE block
    are mapped to their rows by the pass's B, read from the decoder's input before any layer runs."""
    names = {n for entry in groups.bounds if entry[-1] is not None for n in entry[-1].A}
    experts = sorted(n for n in names if len(base.linear_shapes.get(n, ())) == 3)
    rows: list[int] = []  # [B] once the pass starts
    handles = [base.decoder_stack.register_forward_pre_hook(partial(_batch_rows, rows), with_kwargs=True)]
    try:
        for path, module in base.hf.named_modules():
            if path in names and path != UNEMBED:
                handles.append(module.register_forward_hook(
                    lambda _m, args, y, path=path: _apply(groups, rows[0], path, args[0], y)))
        with adapted_experts(base.hf, experts, groups, rows):
            yield
    finally:
        for h in handles:
            h.remove()


@dataclass(kw_only=True)
class GeneralModel(BaseModel):
    """A base model of any other family: the frozen Hugging Face causal LM, whose own modules run."""

    decode_cache = DecodeCache.MODEL
    hf: torch.nn.Module
    hf_decoder: str  # the path of its decoder stack (embeddings, layers, final norm) inside `hf`

    @property
    def decoder_stack(self) -> torch.nn.Module:
        return self.hf.get_submodule(self.hf_decoder)

    def module_paths(self) -> list[str]:
        return [n for n, _ in self.hf.named_modules()]  # a multimodal checkpoint's vision tower's too

    def shard(self, shard: Callable[[torch.nn.Module], None], device: torch.device) -> GeneralModel:
        """This model (loaded on the CPU) with each of its decoder layers, and its embedding, sharded by `shard`
        (units of their own: no root unit over the stack, so a multimodal module that embeds the tokens itself
        gathers in the order the stack does) and the rest of the stack (final norm, rotary tables), a vision tower
        and the unembedding on `device`. The model's own modules run as ever: a sharding wrapper gathers a unit's
        weights around its forward and its backward."""
        stack = self.decoder_stack
        embedding = stack.get_input_embeddings()
        for layer in stack.layers:
            shard(layer)
        shard(embedding)
        for child in stack.children():
            if child is not stack.layers and child is not embedding:
                child.to(device)
        for child in self.vision.model.children() if self.vision else ():  # its vision tower and projector
            if child is not stack:
                child.to(device)
        head = self.hf.get_output_embeddings().to(device)  # never run (BaseModel.unembed uses its weight)
        return replace(self, embed=self.embed.to(device), lm_head=head.weight.detach())

    def forward_hidden(self, tokens: torch.Tensor, groups: RowGroups,
                       images: list[list[ProcessedImage]] | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] of right-padded tokens [B, T] through the model's own decoder,
        each row with its group's adapter; rows holding images go through the multimodal module
        (`multimodal_hidden`). No attention mask: causal attention (and a causal recurrence, for
        linear-attention layers) never lets right padding reach a real position, which `_self_check` verified
        at load."""
        if images and any(images):
            return self.multimodal_hidden(tokens, images, groups)
        with adapted(self, groups):
            return self.decoder_stack(input_ids=tokens, use_cache=False).last_hidden_state

    def multimodal_hidden(self, tokens: torch.Tensor, images: list[list[ProcessedImage]], groups: RowGroups,
                          cache=None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] of right-padded tokens [B, T] whose rows hold `images` (some rows
        none), each row with its group's adapter, through the inner multimodal module's own forward (vision.py);
        with `cache` (a model cache, empty: a prefill) the cache is filled in place."""
        kwargs = model_inputs(self.vision, tokens, images, self.compute_dtype)
        with adapted(self, groups):
            out = self.vision.model(input_ids=tokens, cache=cache, use_cache=cache is not None, **kwargs)
        return out.last_hidden_state

    def cached_hidden(self, tokens: torch.Tensor, groups: RowGroups, cache, **positions) -> torch.Tensor:
        """Hidden states [B, T, D] of tokens [B, T] appended to the model's own cache `cache` (a prefill when it
        is empty, a decode step when T = 1), extended in place; `positions`: the decoder's position_ids and
        attention_mask where rows are not all aligned from position 0 (sampling/hf_sampler.py)."""
        with adapted(self, groups):
            return self.decoder_stack(input_ids=tokens, cache=cache, use_cache=True, **positions).last_hidden_state

    def new_cache(self):
        """An empty cache of the model's own kind (key/value, and conv/recurrent states for linear attention)."""
        from transformers import DynamicCache

        return DynamicCache(config=self.hf.config)
