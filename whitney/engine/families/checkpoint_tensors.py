"""A safetensors checkpoint read parameter by parameter, and rows of a parameter at a time: where each parameter of a
Hugging Face model is in the checkpoint (through Hugging Face's own key renames and converters for that model), and
reading it whole or only some of its rows (safetensors reads only those bytes). Used to load a model built with its
parameters on the meta device: a sharded base, each rank reading its own shards (rank_local.py), and a multimodal
checkpoint's vision parts around a text model already loaded (vision.py).

Shape legend: R rows of a parameter (dim 0), E experts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn


def tensor_files(path: Path) -> dict[str, Path] | None:
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


@dataclass(frozen=True)
class Stacked:
    """A parameter [E, ...] that Hugging Face's loading builds from E checkpoint tensors, one per index of its dim 0
    (a MoE layer's per-expert weights), by a converter that stacks them on dim 0 and then only works on other dims
    (e.g. concatenates gate and up on dim 1): its rows [a, b) are the converter's output for the tensors a..b-1."""

    keys: dict[str, list[str]]  # the converter's source pattern -> its checkpoint keys, by index of dim 0
    converter: object  # transformers' WeightConverter

    @property
    def rows(self) -> int:
        return len(next(iter(self.keys.values())))


# Where a parameter's values are in the checkpoint: its tensor's key, or a stack of tensors.
Source = str | Stacked


def checkpoint_sources(hf: nn.Module, files: dict[str, Path]) -> dict[str, Source] | None:
    """Each checkpoint-held parameter and buffer of the Hugging Face model `hf` (by name) -> its source; None where
    one's tensor has another shape or a converter does more than stack tensors on dim 0 (the caller then loads the
    model whole, through Hugging Face)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (Concatenate, MergeModulelist, WeightConverter, dot_natural_key,
                                                 rename_source_key)

    transforms = get_model_conversion_mapping(hf)
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    held = hf.state_dict(keep_vars=True)
    sources: dict[str, Source] = {}
    stacks: dict[str, tuple[object, dict[str, list[str]]]] = {}
    for key in sorted(files, key=dot_natural_key):  # a stack's tensors by their index
        target, pattern = rename_source_key(key, renamings, converters, hf.base_model_prefix, held)
        if pattern is None:
            sources[target] = key
            continue
        converter = next(c for c in converters if pattern in c.source_patterns)
        first, *rest = converter.operations
        if not (isinstance(first, MergeModulelist) and first.dim == 0
                and all(isinstance(op, Concatenate) and op.dim != 0 for op in rest)):
            return None
        stacks.setdefault(target, (converter, {}))[1].setdefault(pattern, []).append(key)
    sources.update({target: Stacked(keys, converter) for target, (converter, keys) in stacks.items()})
    shapes = _shapes(files)
    for name, tensor in held.items():
        source = sources.get(name)
        if isinstance(source, str) and shapes[source] != tuple(tensor.shape):
            return None
        if isinstance(source, Stacked) and source.rows != tensor.shape[0]:
            return None
    return sources


def read(files: dict[str, Path], source: Source, start: int = 0, count: int | None = None) -> torch.Tensor:
    """A parameter from the checkpoint, whole, or its rows [start, start + count) only (reading only those): a
    slice of its tensor, or the converter's output for the tensors of those rows."""
    from safetensors import safe_open

    if isinstance(source, str):
        with safe_open(files[source], "pt") as f:
            return f.get_tensor(source) if count is None else f.get_slice(source)[start:start + count]
    end = source.rows if count is None else start + count
    tensors: dict[str, list[torch.Tensor]] = {}
    for pattern, keys in source.keys.items():
        tensors[pattern] = []
        for key in keys[start:end]:
            with safe_open(files[key], "pt") as f:
                tensors[pattern].append(f.get_tensor(key))
    for op in source.converter.operations:
        tensors = op.convert(tensors, source_patterns=source.converter.source_patterns,
                             target_patterns=source.converter.target_patterns)
    (out,) = tensors.values()
    return out


def assign(module: nn.Module, full_name: str, value: torch.Tensor) -> None:
    """Replace the parameter `full_name` of `module` by a frozen float32 one holding `value`."""
    owner, _, leaf = full_name.rpartition(".")
    module.get_submodule(owner)._parameters[leaf] = nn.Parameter(value.float(), requires_grad=False)


def read_into(module: nn.Module, names: list[str], files: dict[str, Path], sources: dict[str, Source],
              prefix: str = "") -> None:
    """The parameters and buffers `names` of `module` (a model built with its parameters on the meta device, or
    part of one at path `prefix` in the model `sources` names) given their checkpoint values, read whole: a
    parameter is replaced (assign), a buffer filled in place."""
    buffers = dict(module.named_buffers())
    for name in names:
        value = read(files, sources[prefix + name])
        if name in buffers:
            with torch.no_grad():
                buffers[name].copy_(value)
        else:
            assign(module, name, value)


def _shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every checkpoint tensor's shape, from the safetensors headers."""
    from safetensors import safe_open

    out = {}
    for file in set(files.values()):
        with safe_open(file, "pt") as f:
            out.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
    return out
