"""The sampler's rows in a general-path model's own cache (families/general.py): the cache strategy of
`DecodeCache.MODEL` (`ModelRows`), every running row in one decode pass.

Prefill: requests whose prompts have the same length are prefilled together, each length apart, into a fresh
cache of the model's own kind (keys and values; conv and recurrent states for linear-attention layers), so no
prompt is ever padded; the cache is copied into each request's `num_samples` rows.

Decode: the running rows are the rows of one cache (a `_Batch`), so one decode step is one forward of the
model whatever the number of requests. Rows of different lengths are aligned on the right: a shorter row's
keys and values are padded on the left, the padding masked out by a 2D attention mask, and each row's position
id is its own length (RoPE turns by the row's real position). Conv and recurrent states of linear-attention
layers (Qwen3.5's Gated DeltaNet) have no length: they are concatenated as they are, never padded, and
transformers 5.24 never masks them on a one-token step (`create_recurrent_attention_mask` returns None).
When rows leave, the columns that are padding in every row are cut from the left.

Exactness is checked, not assumed: before padding any merge, the sampler decodes a few tokens of three short
prompts merged (one joining late, the longest leaving) and each alone (`padding_is_exact`). A family that
fails the check, or whose cache has a layer kind the merge does not know (static, quantised, indexed), merges
only rows of equal length (no padding, no mask) and decodes the others one batch each.

Images: a prompt with image chunks is prefilled through the model's multimodal module (engine/vision.py), its
rows keeping their mrope delta (Qwen), which every later decode step adds to the row's position; Gemma 3's decode
steps are causal as they are (its bidirectional image block is in the cache already).

Failures: a failing decode pass is redone request by request, each request's cache rebuilt from its own tokens,
so only the request whose own pass fails gets the error (its rows leave in the sampler's `_record`); a failing
prompt pass is the sampler core's to redo (sampler.py).

Shape legend: B running rows, n rows of one request, R prompts of one length, P prompt length, L cache length
(positions, padding included), D hidden, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from whitney.engine.families import vision
from whitney.engine.families.general import GeneralModel
from whitney.engine.families.lora import RowGroups
from whitney.engine.sampling.rows import Row, SampleRequest, adapter_groups

# Hidden states of the merged check must equal each row alone within this, times max(1, their scale).
CHECK_ATOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _cache_kinds():
    from transformers.cache_utils import (DynamicLayer, DynamicSlidingWindowLayer,
                                          LinearAttentionAndFullAttentionLayer,
                                          LinearAttentionAndSlidingWindowAttentionLayer, LinearAttentionLayer)

    return (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer,
            LinearAttentionAndSlidingWindowAttentionLayer)


def _left_pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros on the left of dim -2 (positions) up to `width`: [B, H, S, E] -> [B, H, width, E]."""
    return t if t.shape[-2] == width else torch.nn.functional.pad(t, (0, 0, width - t.shape[-2], 0))


@dataclass(eq=False)
class _Batch:
    """Rows decoding together in one cache of the model's own kind, aligned on the right: the cache spans
    `span` positions and row b's own tokens are its last `lengths[b]`, the positions before them padding."""

    cache: object  # a transformers DynamicCache with len(lengths) rows
    lengths: list[int]
    span: int
    # Per row, how far its next mrope position is ahead of its length (a Qwen row with images in its prompt,
    # vision.rope_deltas); empty: 0 for every row.
    deltas: list[int] = field(default_factory=list)

    def row_deltas(self) -> list[int]:
        return self.deltas or [0] * self.rows

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def padded(self) -> bool:
        return min(self.lengths) < self.span

    def joinable(self, other: "_Batch") -> bool:
        """Whether every layer of both caches is a kind `join` merges, in the same state."""
        kinds = _cache_kinds()
        if len(self.cache.layers) != len(other.cache.layers):
            return False
        for a, b in zip(self.cache.layers, other.cache.layers):
            if type(a) is not type(b) or type(a) not in kinds:
                return False
            for states in ("conv_states", "recurrent_states"):
                if any((x is None) != (y is None) for x, y in zip(getattr(a, states, {}).values(),
                                                                   getattr(b, states, {}).values())):
                    return False
            if getattr(a, "is_initialized", False) != getattr(b, "is_initialized", False):
                return False
        return True

    def join(self, other: "_Batch") -> None:
        """Append other's rows after this batch's, in place; both stay aligned on the right (call `joinable`
        first: a failure half-way would leave this cache broken)."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionCacheLayerMixin

        span = max(self.span, other.span)
        for a, b in zip(self.cache.layers, other.cache.layers, strict=True):
            if isinstance(a, LinearAttentionCacheLayerMixin):  # [n, ...] states without positions: stacked
                for states in ("conv_states", "recurrent_states"):
                    mine, theirs = getattr(a, states), getattr(b, states)
                    for i, s in mine.items():
                        if s is not None:
                            mine[i] = torch.cat([s, theirs[i]])
            if isinstance(a, DynamicLayer) and a.is_initialized:
                # Keys and values [n, H, S, E]; a sliding layer holds its last min(span, window - 1) positions.
                width = max(a.keys.shape[-2], b.keys.shape[-2])
                a.keys = torch.cat([_left_pad(a.keys, width), _left_pad(b.keys, width)])
                a.values = torch.cat([_left_pad(a.values, width), _left_pad(b.values, width)])
                if isinstance(a, DynamicSlidingWindowLayer):
                    a.cumulative_length = span
        self.deltas = self.row_deltas() + other.row_deltas() if self.deltas or other.deltas else []
        self.lengths = self.lengths + other.lengths
        self.span = span

    def select(self, rows: list[int]) -> None:
        """Keep only these rows (local indices, in order), then cut the positions padded in every row."""
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        if rows != list(range(self.rows)):
            self.cache.reorder_cache(torch.tensor(rows, dtype=torch.int64, device="cpu"))
            self.deltas = [self.deltas[r] for r in rows] if self.deltas else []
            self.lengths = [self.lengths[r] for r in rows]
        span = max(self.lengths)
        if span < self.span:
            for layer in self.cache.layers:
                if isinstance(layer, DynamicLayer) and layer.is_initialized:
                    keep = span
                    if isinstance(layer, DynamicSlidingWindowLayer):
                        keep = min(span, layer.sliding_window - 1)
                        layer.cumulative_length = span
                    layer.keys, layer.values = layer.keys[..., -keep:, :], layer.values[..., -keep:, :]
            self.span = span


def step_hidden(base: GeneralModel, tokens: torch.Tensor, groups: RowGroups, batch: _Batch) -> torch.Tensor:
    """Hidden states [B, T, D] of tokens [B, T] appended to every row of `batch` (a prefill when its cache is
    empty, a decode step when T = 1), each row with its group's adapter; the batch grows in place.

    A padded batch gets the 2D mask [B, L + T] (1 on each row's own positions and the new ones) and position
    ids [B, T] counted from each row's own length; a batch with mrope deltas (Qwen rows with images) gets
    position ids [4, B, T]: the text positions, then the three mrope axes, each the text position plus the
    row's delta."""
    kwargs = {}
    if batch.padded or any(batch.deltas):
        dev, T = tokens.device, tokens.shape[1]
        lengths = torch.tensor(batch.lengths, dtype=torch.int64, device="cpu").to(dev)  # [B]
        positions = lengths[:, None] + torch.arange(T, device=dev)[None, :]  # [B, T]
        kwargs = dict(position_ids=positions)
        if batch.padded:
            columns = torch.arange(batch.span + T, device=dev)  # [L + T]
            kwargs["attention_mask"] = (columns[None, :] >= (batch.span - lengths)[:, None]).long()
        if any(batch.deltas):
            deltas = torch.tensor(batch.deltas, dtype=torch.int64, device="cpu").to(dev)[:, None]  # [B, 1]
            kwargs["position_ids"] = torch.stack([positions] + [positions + deltas] * 3)  # [4, B, T]
    hidden = base.cached_hidden(tokens, groups, batch.cache, **kwargs)
    batch.lengths = [n + tokens.shape[1] for n in batch.lengths]
    batch.span += tokens.shape[1]
    return hidden


_step = step_hidden  # the check below runs this one, whatever replaces the module's step_hidden (tests do)


def _prefilled(base: GeneralModel, tokens: torch.Tensor, groups: RowGroups, step=None,
               images: list[list] | None = None) -> tuple[_Batch, torch.Tensor]:
    """A new batch holding tokens [R, P] (no padding) and their hidden states [R, P, D], by `step` (default
    the module's step_hidden); rows with `images` (per row, vision.ProcessedImage) through the model's multimodal
    module (GeneralModel.multimodal_hidden), each row's mrope delta kept for its decode steps."""
    batch = _Batch(base.new_cache(), [0] * tokens.shape[0], 0)
    if not images or not any(images):
        return batch, (step or step_hidden)(base, tokens, groups, batch)
    hidden = base.multimodal_hidden(tokens, images, groups, cache=batch.cache)
    batch.lengths, batch.span = [tokens.shape[1]] * tokens.shape[0], tokens.shape[1]
    batch.deltas = [vision.rope_deltas(base.vision, row, im) for row, im in zip(tokens, images)]
    return batch, hidden


def padding_is_exact(base: GeneralModel) -> bool:
    """Whether rows merged with left padding decode as each row alone: three short prompts (3, 6 and 2 tokens)
    decode three tokens each alone; merged, the first two decode one step, the third joins for the next, and the
    longest leaves (its positions cut) before the last. Every merged hidden state must equal the row's alone
    within CHECK_ATOL."""
    g = torch.Generator(device="cpu").manual_seed(0)
    vocab, dev, none = base.config.vocab_size, base.device, RowGroups([])
    prompts = [torch.randint(0, vocab, (1, n), generator=g, device="cpu").to(dev) for n in (3, 6, 2)]
    steps = torch.randint(0, vocab, (3, 3), generator=g, device="cpu").to(dev)  # row i's token at its step s
    alone = []
    for i, p in enumerate(prompts):
        batch, _ = _prefilled(base, p, none, _step)
        alone.append([_step(base, steps[i, s].view(1, 1), none, batch)[0, 0] for s in range(3)])
    batch, _ = _prefilled(base, prompts[0], none, _step)
    other = _prefilled(base, prompts[1], none, _step)[0]
    if not batch.joinable(other):
        return False
    batch.join(other)
    merged = [(_step(base, steps[:2, :1], none, batch)[:, 0], [alone[0][0], alone[1][0]])]
    batch.join(_prefilled(base, prompts[2], none, _step)[0])
    tokens = torch.stack([steps[0, 1], steps[1, 1], steps[2, 0]])[:, None]  # [3, 1]
    merged.append((_step(base, tokens, none, batch)[:, 0], [alone[0][1], alone[1][1], alone[2][0]]))
    batch.select([0, 2])  # the longest row leaves: its extra positions are cut
    tokens = torch.stack([steps[0, 2], steps[2, 1]])[:, None]
    merged.append((_step(base, tokens, none, batch)[:, 0], [alone[0][2], alone[2][1]]))
    atol = CHECK_ATOL.get(base.compute_dtype, 5e-2)
    for got, want in merged:
        want = torch.stack(want).float()  # [rows, D]
        if not torch.allclose(got.float(), want, rtol=0, atol=atol * max(1.0, float(want.abs().max()))):
            return False
    return True


class ModelRows:
    """The sampler's rows as the rows of its batches, in order: a general-path model's own cache."""

    def __init__(self, base: GeneralModel):
        self.base = base
        self.device = base.device
        self.batches: list[_Batch] = []
        self.pads: bool | None = None  # whether rows of different lengths may merge (padding_is_exact), once

    @property
    def rows(self) -> int:
        return sum(batch.rows for batch in self.batches)

    def _may_pad(self) -> bool:
        if self.pads is None:
            try:
                self.pads = padding_is_exact(self.base)
            except Exception:  # the model's forward refuses a mask or position ids: never pad
                self.pads = False
        return self.pads

    def prefill_passes(self, requests: list[SampleRequest]) -> list[list[SampleRequest]]:
        """The prompts of each length together (no prompt is ever padded)."""
        by_length: dict[int, list[SampleRequest]] = {}
        for r in requests:
            by_length.setdefault(len(r.prompt), []).append(r)
        return list(by_length.values())

    def prefill(self, tokens: torch.Tensor, groups: RowGroups, images: list[list]) -> tuple[torch.Tensor, _Batch]:
        """Hidden states [R, P, D] of prompts of one length [R, P], and a new batch holding them."""
        batch, hidden = _prefilled(self.base, tokens, groups, images=images)
        return hidden, batch

    def add(self, prefilled: _Batch, copies: list[int], lengths: list[int]) -> None:
        """The new batch's prompt rows copied into the sampler's new rows (copies[i]: row i's prompt), after the
        running ones."""
        prefilled.select(copies)  # one cache row per prompt -> num_samples rows per request
        self.batches.append(prefilled)

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows of the sampler (finished sequences leave)."""
        kept, offset, out = set(rows.tolist()), 0, []
        for batch in self.batches:
            local = [j for j in range(batch.rows) if offset + j in kept]
            offset += batch.rows
            if local:  # a batch left empty is dropped as it is (its cache may be broken by a failed pass)
                batch.select(local)
                out.append(batch)
        self.batches = out

    def settle(self) -> None:
        """Join consecutive batches into one where they can be (rows keep their order)."""
        out: list[_Batch] = []
        for batch in self.batches:
            last = out[-1] if out else None
            if (last is not None and (last.span == batch.span or self._may_pad()) and last.joinable(batch)):
                last.join(batch)
            else:
                out.append(batch)
        self.batches = out

    def decode(self, tokens: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Hidden states [B, D] of every row's next token [B]: one pass per batch (one batch unless the model
        cannot pad); a batch whose pass fails is redone request by request (`_redo_alone`)."""
        parts, offset = [], 0
        for batch in list(self.batches):
            mine, next_tokens = rows[offset:offset + batch.rows], tokens[offset:offset + batch.rows]
            offset += batch.rows
            try:
                hidden = step_hidden(self.base, next_tokens[:, None], adapter_groups(mine, self.device), batch)[:, 0]
            except Exception:  # [n, D] per request, each request alone
                hidden = self._redo_alone(batch, mine, next_tokens)
            parts.append(hidden)
        return torch.cat(parts)

    def _redo_alone(self, failed: _Batch, rows: list[Row], tokens: torch.Tensor) -> torch.Tensor:
        """After a failed decode pass (its cache is now unknown), each request of the batch alone: its cache
        rebuilt from its prompt and the tokens its rows have cached, then its decode step. A request whose own
        pass fails gets the error and zeros (its rows leave in the sampler's _record). Returns hidden states
        [B, D]."""
        spans: list[tuple[SampleRequest, list[int]]] = []  # each request's rows, contiguous in the batch
        for b, row in enumerate(rows):
            if spans and spans[-1][0] is row.request:
                spans[-1][1].append(b)
            else:
                spans.append((row.request, [b]))
        batches, parts = [], []
        for request, idx in spans:
            groups = RowGroups([(0, len(idx), request.adapter)])
            cached = torch.tensor([request.prompt + rows[b].tokens[:-1] for b in idx], dtype=torch.int64,
                                  device="cpu").to(self.device)  # [n, P + t - 1]: the last token is pending
            try:
                batch, _ = _prefilled(self.base, cached, groups, images=[request.images] * len(idx))
                parts.append(step_hidden(self.base, tokens[idx[0]:idx[-1] + 1, None], groups, batch)[:, 0])
            except Exception as e:
                request.error = e
                batch = _Batch(None, [0] * len(idx), 0)  # stands for the rows until they leave
                parts.append(torch.zeros(len(idx), self.base.config.hidden_size, dtype=self.base.compute_dtype,
                                         device=self.device))
            batches.append(batch)
        at = self.batches.index(failed)
        self.batches[at:at + 1] = batches
        return torch.cat(parts)
