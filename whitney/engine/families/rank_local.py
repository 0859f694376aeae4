"""Rank-local loading: a base model sharded over the ranks of a process group, each rank reading only its own
shards of the decoder layers from the checkpoint.

The model is built on the meta device (no memory). Its replicated parts (embedding, final norm, unembedding) are
read whole and its rotary tables computed; each decoder layer weight stays on meta through the family's build and the
sharding (`Decoder.shard`: FSDP2 turns it into a meta DTensor), then `to_empty` gives each rank storage for its own
shard (dim 0: FSDP2's chunk of ceil(rows / N) rows), which is filled with those rows of the checkpoint tensor,
read as a slice of its safetensors file (safetensors reads only those bytes). Peak host memory per rank: about
the replicated parts plus 1/N of the layer weights (docs/BENCHMARKS.md), where loading whole and sharding after
held the whole model.

Served this way: the fast families (transformer.py), whose layer weights are the checkpoint's tensors one to one
(`transformer.layer_checkpoint_keys`), from a safetensors checkpoint. A general-path model (its modules, key
renames and expert conversions are Hugging Face's own; its load check runs forwards of the whole model, whose
gathered layers would stay in the heap: docs/BENCHMARKS.md) is loaded whole, then sharded
(`load_whole_then_shard`), and so is any other checkpoint.

Shape legend: N ranks, R rows of a weight (dim 0).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from whitney.engine.families import hub_cache
from whitney.engine.families.decoder import BaseModel
from whitney.engine.families.model import SUPPORTED_TYPES, load_base_model, resolve_model_dir
from whitney.engine.families.transformer import layer_checkpoint_keys, load_transformer
from whitney.protocol.config import shown_name


def load_sharded(name: str, compute_dtype: torch.dtype, shard: Callable[[nn.Module], None], device: torch.device,
                 rank: int, ranks: int) -> BaseModel:
    """The base model `name` with its decoder layers sharded by `shard` over `ranks` ranks (this one `rank`), the
    rest on `device`: read rank-locally where the family allows (see the module docstring), else whole first."""
    from transformers import AutoConfig

    path = resolve_model_dir(name)
    files = _tensor_files(path)
    config = AutoConfig.from_pretrained(path)
    hf = _skeleton(config, files) if config.model_type in SUPPORTED_TYPES and files is not None else None
    if hf is None:
        return load_whole_then_shard(name, compute_dtype, shard, device)
    hub_cache.register(shown_name(name), path)
    base = load_transformer(name, path, hf, _tokenizer(path), compute_dtype, "cpu")
    sharded = base.shard(shard, device)
    for i, module in enumerate(sharded.layers.layers):
        # Storage for this rank's shards only, a layer at a time (FSDP2 copies each into its own padded storage).
        module.to_empty(device=device)
        keys = layer_checkpoint_keys(i)
        for param_name, param in module.named_parameters():
            _fill_rows(param.to_local(), files, keys[param_name], rank, ranks)
    return sharded


def load_whole_then_shard(name: str, compute_dtype: torch.dtype, shard: Callable[[nn.Module], None],
                          device: torch.device) -> BaseModel:
    """Every weight read (on the CPU), then the layers sharded: host memory of the whole model while loading."""
    return load_base_model(name, compute_dtype, "cpu").shard(shard, device)


def held_weights(base: BaseModel) -> list[torch.Tensor]:
    """Every frozen weight a fast-family base holds in this process (a sharded one: its own shards of the layers),
    e.g. to read them all, which makes weights resident that a load only mapped from their file."""
    if isinstance(base.layers, nn.Module):
        layers = [p.to_local() for p in base.layers.parameters()]
    else:
        layers = [t for lw in base.layers for t in (lw.input_norm, lw.post_attn_norm, *lw.linear.values(),
                                                    *lw.bias.values())]
    return [base.embed, base.lm_head, base.final_norm, *layers]


def _tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tensor_files(path: Path) -> dict[str, Path] | None:
    """Checkpoint tensor name -> its safetensors file (one file, or a sharded checkpoint's index); None where the
    checkpoint is not in safetensors."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        return {k: path / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = path / "model.safetensors"
    if not single.exists():
        return None
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return {k: single for k in f.keys()}


def _read(files: dict[str, Path], key: str) -> torch.Tensor:
    """The checkpoint tensor `key`, whole."""
    from safetensors import safe_open

    with safe_open(files[key], "pt") as f:
        return f.get_tensor(key)


def _skeleton(config, files: dict[str, Path]) -> nn.Module | None:
    """The Hugging Face model of `config` with its replicated weights read from the checkpoint and its decoder
    layers' weights on the meta device (no storage); None where the checkpoint lacks one of those weights or the
    model holds a buffer this does not compute (it is then loaded whole)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    replicated = [n for n, _ in hf.named_parameters() if not n.startswith("model.layers.")]
    if any(n not in files for n in replicated):
        return None
    for full_name in replicated:
        owner, _, leaf = full_name.rpartition(".")
        value = _read(files, full_name).float()
        hf.get_submodule(owner)._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    if getattr(config, "tie_word_embeddings", False):
        hf.lm_head.weight = hf.model.embed_tokens.weight
    hf.model.rotary_emb = type(hf.model.rotary_emb)(config=config)  # its tables, computed (not in the checkpoint)
    return None if any(b.is_meta for b in hf.buffers()) else hf


def _fill_rows(local: torch.Tensor, files: dict[str, Path], key: str, rank: int, ranks: int) -> None:
    """Fill this rank's shard `local` [r, ...] of a weight sharded on dim 0 (FSDP2: chunks of ceil(R / N) rows,
    rank k's from row k * ceil(R / N)) with those rows of the checkpoint tensor."""
    if local.numel() == 0:
        return
    from safetensors import safe_open

    with safe_open(files[key], "pt") as f:
        whole_rows = f.get_slice(key).get_shape()[0]
        start = rank * -(-whole_rows // ranks)
        with torch.no_grad():
            local.copy_(f.get_slice(key)[start:start + local.shape[0]])
