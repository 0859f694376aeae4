"""Rank-local loading: a base model sharded over the ranks of a process group, each rank reading only its own
shards of the decoder layers from the checkpoint.

The Hugging Face model is built with its parameters on the meta device (no memory; its computed buffers, such as
rotary tables, real). Its replicated parts (embedding, final norm, unembedding, a vision tower) are read whole; each
decoder layer weight stays on meta through the family's build and the sharding (FSDP2 turns it into a meta DTensor),
then `to_empty` gives each rank storage for its own shard (dim 0: FSDP2's chunk of ceil(rows / N) rows), which is
filled with those rows of the checkpoint tensor, read as a slice of its safetensors file (safetensors reads only
those bytes). Peak host memory per rank: about the replicated parts plus 1/N of the layer weights
(docs/BENCHMARKS.md), where loading whole and sharding after held the whole model.

Both paths load this way. A fast family (transformer.py) maps its layer weights to the checkpoint's tensors by
`transformer.layer_checkpoint_keys`. A general-path model (general.py) is admitted by its load check (`admit`) run
on the shortest prefix of its layers that holds one layer of each structure, read whole before sharding: the check
is about what a kind of layer computes (causal, nothing after the head), not the values of its weights, and a
forward of the whole sharded model would leave every gathered layer in the heap (docs/BENCHMARKS.md). A checkpoint
whose tensors are not the model's parameters one to one (by name and shape: Hugging Face's conversions, such as
per-expert weights stacked at load) or that is not in safetensors is loaded whole, then sharded
(`load_whole_then_shard`). No family is refused.

Shape legend: N ranks, R rows of a weight (dim 0).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from whitney.engine.families import hub_cache
from whitney.engine.families.checkpoint_tensors import (Source, assign, checkpoint_sources, read, read_into,
                                                        tensor_files)
from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.general import GeneralModel, admit, decoder_of, load_general
from whitney.engine.families.model import SUPPORTED_TYPES, load_base_model, resolve_model_dir
from whitney.engine.families.transformer import layer_checkpoint_keys, load_transformer
from whitney.protocol.config import shown_name


def load_sharded(name: str, compute_dtype: torch.dtype, shard: Callable[[nn.Module], None], device: torch.device,
                 rank: int, ranks: int) -> BaseModel:
    """The base model `name` with its decoder layers sharded by `shard` over `ranks` ranks (this one `rank`), the
    rest on `device`: read rank-locally where the checkpoint allows (see the module docstring), else whole first."""
    from transformers import AutoConfig

    path = resolve_model_dir(name)
    files = tensor_files(path)
    skeleton = _skeleton(AutoConfig.from_pretrained(path), files) if files is not None else None
    if skeleton is None:
        return load_whole_then_shard(name, compute_dtype, shard, device)
    hf, sources = skeleton
    hub_cache.register(shown_name(name), path)
    tokenizer = _tokenizer(path)
    if hf.config.model_type in SUPPORTED_TYPES:
        sharded = load_transformer(name, path, hf, tokenizer, compute_dtype, "cpu").shard(shard, device)
        layers, names = sharded.layers.layers, layer_checkpoint_keys
    else:
        decoder_path, decoder = decoder_of(hf)
        _admit_on_first_layers(name, hf, files, sources)
        sharded = load_general(name, path, hf, tokenizer, compute_dtype, None, admitted=True).shard(shard, device)
        layers = decoder.layers

        def names(i: int) -> dict[str, str]:
            return {n: f"{decoder_path}.layers.{i}.{n}" for n, _ in layers[i].named_parameters()}
    for i, module in enumerate(layers):
        hf_names = names(i)
        _fill_layer(module, {n: sources[hf_names[n]] for n, _ in module.named_parameters()}, files, device, rank,
                    ranks)
    return sharded


def load_whole_then_shard(name: str, compute_dtype: torch.dtype, shard: Callable[[nn.Module], None],
                          device: torch.device) -> BaseModel:
    """Every weight read (on the CPU), then the layers sharded: host memory of the whole model while loading."""
    return load_base_model(name, compute_dtype, "cpu").shard(shard, device)


def held_weights(base: BaseModel) -> list[torch.Tensor]:
    """Every frozen weight a base holds in this process (a sharded one: its own shards of the layers), e.g. to read
    them all, which makes weights resident that a load only mapped from their file."""
    if isinstance(base, GeneralModel):
        return [base.embed, *(_local(p) for p in base.hf.parameters())]
    if isinstance(base.layers, nn.Module):
        layers = [_local(p) for p in base.layers.parameters()]
    else:
        layers = [t for lw in base.layers for t in (lw.input_norm, lw.post_attn_norm, *lw.linear.values(),
                                                    *lw.bias.values())]
    return [base.embed, base.lm_head, base.final_norm, *layers]


def _local(weight: torch.Tensor) -> torch.Tensor:
    return weight.to_local() if isinstance(weight, DTensor) else weight


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _skeleton(config, files: dict[str, Path]) -> tuple[nn.Module, dict[str, Source]] | None:
    """The Hugging Face model of `config` with its replicated parameters read from the checkpoint, its decoder
    layers' parameters on the meta device (no storage) and its buffers computed, or copied where the checkpoint
    holds them, and the source of each parameter (checkpoint_tensors.py); None where the checkpoint does not give every
    parameter (it is then loaded whole)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    with init_empty_weights(include_buffers=False):
        try:
            hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        except ValueError:  # no causal-LM class: a vision-language checkpoint (as model.load_base_model)
            if getattr(config, "vision_config", None) is None:
                return None
            hf = AutoModelForImageTextToText.from_config(config, dtype=torch.float32)
    try:
        decoder_path, _ = decoder_of(hf)
    except ValueError:
        return None
    sources = checkpoint_sources(hf, files)
    tied = getattr(hf, "all_tied_weights_keys", None) or {}  # tied unembedding -> its embedding, not in the file
    if sources is None or any(n not in sources and n not in tied for n, _ in hf.named_parameters()):
        return None
    replicated = [n for n, _ in hf.named_parameters() if n in sources and not n.startswith(f"{decoder_path}.layers.")]
    read_into(hf, [*replicated, *(n for n, _ in hf.named_buffers() if n in sources)], files, sources)
    hf.tie_weights()
    replicated_meta = [n for n, p in hf.named_parameters(remove_duplicate=False)
                       if p.is_meta and not n.startswith(f"{decoder_path}.layers.")]
    return None if replicated_meta else (hf, sources)


def _admit_on_first_layers(name: str, hf: nn.Module, files: dict[str, Path], sources: dict[str, Source]) -> None:
    """general.admit on the shortest prefix of the decoder's layers holding one layer of each structure (its
    modules' types and its entry in each per-layer list of the config), read whole for the check, then back on
    meta."""
    decoder_path, decoder = decoder_of(hf)
    layers = decoder.layers
    text = hf.config.get_text_config()
    per_layer = [v for _, v in sorted(vars(text).items()) if isinstance(v, (list, tuple)) and len(v) == len(layers)]
    kinds = [(tuple(type(m).__name__ for m in layer.modules()), tuple(v[i] for v in per_layer))
             for i, layer in enumerate(layers)]
    prefix = layers[:max(kinds.index(k) for k in set(kinds)) + 1]
    for i, layer in enumerate(prefix):
        read_into(layer, [n for n, _ in layer.named_parameters()], files, sources, f"{decoder_path}.layers.{i}.")
    decoder.layers = prefix
    try:
        admit(name, hf)
    finally:
        decoder.layers = layers
        for layer in prefix:
            for param_name, param in list(layer.named_parameters()):
                assign(layer, param_name, torch.empty_like(param, device="meta"))


def _fill_layer(module: nn.Module, sources: dict[str, Source], files: dict[str, Path], device: torch.device,
                rank: int, ranks: int) -> None:
    """Give the sharded layer `module` storage for this rank's shards (FSDP2 copies each into its own padded
    storage) and fill each parameter's [r, ...] with its rows of the checkpoint (FSDP2 shards dim 0 in chunks of
    ceil(R / N) rows, rank k's from row k * ceil(R / N)); `sources`: parameter name -> its source. Its buffers,
    which `to_empty` would leave undefined, are kept."""
    buffers = {n: b.clone() for n, b in module.named_buffers()}
    module.to_empty(device=device)
    with torch.no_grad():
        for n, b in module.named_buffers():
            b.copy_(buffers[n])
        for param_name, param in module.named_parameters():
            local = param.to_local()
            if local.numel():
                whole_rows = param.shape[0]
                local.copy_(read(files, sources[param_name], rank * -(-whole_rows // ranks), local.shape[0]))
