"""The sampler's rows in one ragged KV cache (a fast family's `transformer.KVCache`): the cache strategy of
`DecodeCache.KV`.

Every prompt of an admission is prefilled in one pass, right-padded (causal attention: padding never reaches a
real position); each row's keys and values are copied into the cache, left-aligned, valid up to its own length;
a decode step writes each row's new key and value at its own position, one pass over every row whatever their
lengths. A failing decode pass raises: the cache is one batch, which no request can leave alone.

Shape legend: B running rows, R prompts, P prompt length, D hidden.
"""

from __future__ import annotations

import torch

from whitney.engine.families.lora import RowGroups
from whitney.engine.families.transformer import KVCache, TransformerModel
from whitney.engine.sampling.rows import Row, SampleRequest, adapter_groups

Prefilled = list[tuple[torch.Tensor, torch.Tensor]]  # per layer: keys, values [R, G, P, E] of the prompts


class KVRows:
    """Row b of the sampler is row b of one KVCache."""

    def __init__(self, base: TransformerModel):
        self.base = base
        self.kv = KVCache.empty(base)

    @property
    def rows(self) -> int:
        return self.kv.rows

    def prefill_passes(self, requests: list[SampleRequest]) -> list[list[SampleRequest]]:
        """Every prompt in one pass."""
        return [requests]

    def prefill(self, tokens: torch.Tensor, groups: RowGroups, images: list[list]) -> tuple[torch.Tensor, Prefilled]:
        """Hidden states [R, P, D] of right-padded prompts [R, P], and their keys and values."""
        kv: Prefilled = []
        return self.base.forward_hidden(tokens, groups, kv_out=kv), kv

    def add(self, prefilled: Prefilled, copies: list[int], lengths: list[int]) -> None:
        """New rows after the running ones: row i holds prompt copies[i]'s keys and values, lengths[i] long."""
        index = torch.tensor(copies, device=self.base.device)
        self.kv.append([(k[index], v[index]) for k, v in prefilled],
                       torch.tensor(lengths, device=self.base.device))

    def decode(self, tokens: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Hidden states [B, D] of every row's next token [B], each row cached one token further."""
        return self.base.decode_hidden(tokens, adapter_groups(rows, self.base.device), self.kv)

    def keep(self, rows: torch.Tensor) -> None:
        self.kv.keep(rows)

    def settle(self) -> None:
        """Nothing to merge: every row is in the one cache."""
