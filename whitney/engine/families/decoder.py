"""One loaded base model, and the `Decoder` interface every family implements.

A base model is a `BaseModel`: what every family shares (geometry, tokenizer, embedding and unembedding,
adaptable modules, the vision side of a vision-language checkpoint) and the decoder of its family:
  TransformerModel (transformer.py)  llama, qwen2, qwen3: the decoder written out over the frozen weights
  GeneralModel (general.py)          any other decoder-only causal LM, run through its own Hugging Face modules
Callers (training passes, sampling, checkpoints, sharding) go through the `Decoder` methods and never ask which
family they hold. Loading a model by name (and picking its family) is model.py.

Shape legend: B rows, T positions, D hidden size, V vocabulary, R rows of hidden states.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Callable, ClassVar, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from whitney.engine.families.lora import RowGroups
from whitney.engine.families.modules import UNEMBED
from whitney.engine.families.vision import ProcessedImage, VisionModel


@dataclass(frozen=True)
class ModelConfig:
    """The geometry of a decoder-only transformer, read from its Hugging Face config."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_eps: float
    max_context: int
    tie_embeddings: bool
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE
    attention_bias: bool  # Qwen2 has biases on q, k, v


class DecodeCache(StrEnum):
    """How a family keeps the rows it decodes (sampling/ holds one strategy per kind)."""

    KV = "kv"  # transformer.KVCache: every row's keys and values in one ragged batch, each left-aligned
    MODEL = "model"  # the model's own cache (transformers' DynamicCache: keys and values, conv and recurrent states)


class Decoder(ABC):
    """What a family implements: the decoder from token ids to final-norm hidden states, with every row's
    adapter passed in as data (`RowGroups`), and what callers need to know of its modules."""

    decode_cache: ClassVar[DecodeCache]  # the sampling strategy its cache takes

    @abstractmethod
    def forward_hidden(self, tokens: torch.Tensor, groups: RowGroups,
                       images: list[list[ProcessedImage]] | None = None) -> torch.Tensor:
        """Final-norm hidden states [B, T, D] of right-padded tokens [B, T], each row with its group's adapter;
        rows may hold images (per row, in position order) where the model has a vision side."""

    @abstractmethod
    def module_paths(self) -> list[str]:
        """The path of every module of the checkpoint's model (PEFT matches target_modules against them)."""

    @abstractmethod
    def shard(self, shard: Callable[[nn.Module], None], device: torch.device) -> BaseModel:
        """This model (loaded on the CPU) with its decoder layers sharded by `shard` (called on each layer's
        module, then on a root holding them all: FSDP2's `fully_shard` over a mesh, training/sharded.py) and
        the rest on `device`."""


@dataclass(kw_only=True)
class BaseModel(Decoder):
    """One loaded base model: frozen weights, tokenizer and geometry, shared by every run on it. Abstract: a
    loaded model is a family's (see the module docstring)."""

    name: str
    path: Path
    config: ModelConfig
    embed: torch.Tensor  # [V, D]
    lm_head: torch.Tensor  # [V, D]; the same storage as embed when tied
    tokenizer: object
    eos_token_ids: tuple[int, ...]
    compute_dtype: torch.dtype = torch.float32
    # full Hugging Face module path -> (in_features, out_features) of every adaptable linear (in, out, E for
    # a stacked expert projection)
    linear_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # A vision-language checkpoint saved with its image processor: its vision tower and processor; None for a
    # model that takes no images.
    vision: VisionModel | None = None
    # oneDNN-prepacked bfloat16 linear weights for passes without autograd (`prepacked`)
    packed: dict | None = None
    # lm_head [V, D] and its transpose [D, V] in oneDNN's layout for the fused target log-probs' logits and
    # their gradient in h (float32 CPU; losses/unembedding.py); False where unavailable
    packed_lm_head: object = None
    packed_lm_head_t: object = None

    @property
    def device(self) -> torch.device:
        """Where every tensor of this model lives (and where its runs' adapters and caches are made)."""
        return self.embed.device

    def packable_weights(self) -> Iterator[tuple[object, torch.Tensor]]:
        """The linear weights `prepacked` may lay out for oneDNN, by key: the unembedding's, and a family's own."""
        yield UNEMBED, self.lm_head

    def unembed(self, hidden: torch.Tensor, groups: RowGroups) -> torch.Tensor:
        """Logits [R, V] (float32) for hidden rows [R, D]; groups index the R rows."""
        hidden = hidden.to(self.compute_dtype)
        packed = prepacked(self)
        logits = linear(hidden, self.lm_head, None, packed and packed[UNEMBED])  # [R, V]
        return groups.apply(UNEMBED, hidden, logits).float()


def prepacked(base: BaseModel) -> dict | None:
    """Prepacked copies of a bfloat16 base's linear weights ({key: packed}, keys as `packable_weights`), for
    passes without autograd (sampling, scoring): oneDNN otherwise re-lays-out every weight on every call,
    which costs small-batch decode matmuls much of their time; packed, they are bitwise equal. Costs one more
    copy of the linear weights, built on first use. None for float32 (its exact path), off the CPU (a CPU-only
    trick: CUDA's kernels need no re-layout) or without oneDNN."""
    if base.compute_dtype != torch.bfloat16 or base.device.type != "cpu" or torch.is_grad_enabled():
        return None
    if base.packed is None:
        try:
            pack = torch.ops.mkldnn._reorder_linear_weight
            base.packed = {key: pack(w, 16) for key, w in base.packable_weights()}
        except (RuntimeError, AttributeError):
            base.packed = {}
    return base.packed or None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    """x @ weight^T + bias, through the prepacked weight where there is one."""
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


def full_logprobs(logits: torch.Tensor) -> torch.Tensor:
    """Full-vocabulary log-probabilities, [N, V] -> [N, V] float32."""
    return F.log_softmax(logits.float(), dim=-1)
