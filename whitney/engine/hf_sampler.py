"""Sampling on the general path (engine/general.py): the model's own cache, one per request.

`HFSampler` is the `Sampler` (queue, admission limits, seeded choices, stops, log-probs, results) with
its two passes replaced. A request is prefilled alone into a fresh cache of the model's own kind (keys
and values; conv and recurrent states for linear-attention layers), so no row is ever padded or masked,
and the cache is copied into its `num_samples` rows. Each decode step runs every request's rows through
its own cache, with its adapter's LoRA hooks, and the next tokens of all rows are chosen together. Rows
are copied and dropped with the cache's own `reorder_cache` (what beam search uses), which every cache
kind implements for all its states.

Shape legend: B running rows, n rows of one request, P prompt length, D hidden, V vocabulary.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from whitney.engine.general import new_cache, step_hidden
from whitney.engine.lora import RowGroups
from whitney.engine.sampler import SampleRequest, SampleResult, Sampler, _adapter_groups, _Row
from whitney.engine.transformer import unembed


@dataclass
class _Segment:
    """One request's running rows in the model's own cache."""

    request: SampleRequest
    cache: object  # a transformers Cache holding `rows` rows
    rows: int


class _Caches:
    """The sampler's rows as the rows of each request's segment, in order (stands in for KVCache)."""

    def __init__(self):
        self.segments: list[_Segment] = []

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the batch (finished sequences leave)."""
        kept, offset = set(rows.tolist()), 0
        for seg in self.segments:
            local = [j for j in range(seg.rows) if offset + j in kept]
            offset += seg.rows
            if 0 < len(local) < seg.rows:
                seg.cache.reorder_cache(torch.tensor(local, dtype=torch.int64, device="cpu"))
            seg.rows = len(local)
        self.segments = [s for s in self.segments if s.rows]


class HFSampler(Sampler):
    """A `Sampler` over a general-path base model, using the model's own cache."""

    def __init__(self, base, *args, **kwargs):
        super().__init__(base, *args, **kwargs)
        self.cache = _Caches()

    def _prefill(self, requests: list[SampleRequest]) -> None:
        """Prefill each request alone, copy its cache into num_samples rows, choose each row's first token.
        A request whose own pass, unembedding or choice fails gets the error; the others are unaffected."""
        for r in requests:
            n, p = r.params.num_samples, len(r.prompt)
            want_all = r.params.prompt_logprobs or r.params.topk_prompt_logprobs > 0
            try:
                cache = new_cache(self.base)
                tokens = torch.tensor([r.prompt], dtype=torch.int64, device="cpu").to(self.device)  # [1, P]
                hidden = step_hidden(self.base, tokens, RowGroups([(0, 1, r.adapter)]), cache)  # [1, P, D]
                h = hidden[0] if want_all else hidden[0, p - 1:]
                logits = unembed(self.base, h, RowGroups([(0, h.shape[0], r.adapter)]))  # [P or 1, V]
                r.result = SampleResult([None] * n)
                if want_all:
                    self._prompt_logprobs(r, logits)
                if n > 1:
                    cache.reorder_cache(torch.zeros(n, dtype=torch.int64, device="cpu"))  # one row -> n rows
            except Exception as e:
                r.error = e
                continue
            seed = r.params.seed if r.params.seed is not None else random.getrandbits(63)
            rows = [_Row(r, s, torch.Generator(device="cpu").manual_seed((seed + 0x9E3779B97F4A7C15 * s) % 2**63))
                    for s in range(n)]
            r.pending = n
            chosen, lps = self._choose(logits[-1:].expand(n, -1), rows)
            self.cache.segments.append(_Segment(r, cache, n))
            self.rows += rows
            self._pending_tokens = torch.cat([self._pending_tokens, chosen])
            self._record(len(self.rows) - n, chosen, lps)

    def _decode(self) -> None:
        """One token for every running row: each request's rows through its own cache, then one choice."""
        parts, offset = [], 0
        for seg in self.cache.segments:
            tokens = self._pending_tokens[offset:offset + seg.rows]  # [n]
            offset += seg.rows
            try:
                hidden = step_hidden(self.base, tokens[:, None], RowGroups([(0, seg.rows, seg.request.adapter)]),
                                     seg.cache)[:, 0]  # [n, D]
            except Exception as e:  # this request's own pass: it fails alone (its rows leave in _record)
                seg.request.error = e
                hidden = torch.zeros(seg.rows, self.base.config.hidden_size, dtype=self.base.compute_dtype,
                                     device=self.device)
            parts.append(hidden)
        groups = _adapter_groups(self.rows, self.device)
        logits = unembed(self.base, torch.cat(parts), groups)  # [B, V]
        chosen, lps = self._choose(logits, self.rows)
        self._pending_tokens = chosen
        self._record(0, chosen, lps)
