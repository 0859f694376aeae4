"""A sampling request and its rows: what the sampler core (sampler.py) and its cache strategies share.

Shape legend: B running rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whitney.engine.families.lora import Adapter, RowGroups
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams


@dataclass
class SampleRequest:
    """A validated request and its progress. `adapter` None samples the base model."""

    prompt: list[int]
    params: SamplingParams
    adapter: Adapter | None
    stop_ids: set[int] = field(default_factory=set)
    stop_seqs: list[list[int]] = field(default_factory=list)
    stop_strs: list[str] = field(default_factory=list)
    result: SampleResult | None = None
    pending: int = 0  # rows still running
    error: Exception | None = None  # this request alone failed; its rows have left the batch
    cancelled: bool = False  # dropped by Sampler.cancel (its client went away): its rows and cache have left
    stream: bool = False  # keep what is chosen for `take_progress` (set before its first step)
    images: list = field(default_factory=list)  # the prompt's vision.ProcessedImage, in position order
    fresh: SampleProgress | None = None  # chosen since the last take_progress

    def take_progress(self) -> SampleProgress | None:
        """The tokens chosen since the last call (None when there are none), and start afresh."""
        fresh, self.fresh = self.fresh, None
        return fresh

    def note(self, index: int, token: int, logprob: float, top: list[tuple[int, float]] | None) -> None:
        """Keep a token its sample `index` chose, for `take_progress` (a streaming request)."""
        if self.fresh is None:
            n = self.params.num_samples
            self.fresh = SampleProgress([[] for _ in range(n)], [[] for _ in range(n)],
                                        [[] for _ in range(n)] if self.params.top_logprobs else None)
        self.fresh.tokens[index].append(token)
        self.fresh.logprobs[index].append(logprob)
        if self.fresh.top_logprobs is not None:
            self.fresh.top_logprobs[index].append(top)

    @property
    def done(self) -> bool:
        return self.cancelled or self.error is not None or (self.result is not None and self.pending == 0)

    @property
    def reserved_tokens(self) -> int:
        return self.params.num_samples * (len(self.prompt) + self.params.max_tokens)


@dataclass
class Row:
    """One running sample of a request."""

    request: SampleRequest
    index: int  # which of the request's samples
    generator: torch.Generator  # on the CPU (see sampler.py's docstring)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)  # when the request asks for them


def adapter_groups(rows: list[Row], device: torch.device) -> RowGroups:
    """Decode-batch rows grouped by adapter as index tensors on `device` (rows of one adapter need not be
    adjacent)."""
    by_adapter: dict[int, tuple[list[int], Adapter]] = {}
    for b, row in enumerate(rows):
        if row.request.adapter is not None:
            by_adapter.setdefault(id(row.request.adapter), ([], row.request.adapter))[0].append(b)
    return RowGroups([(torch.tensor(idx, device=device), adapter) for idx, adapter in by_adapter.values()])
