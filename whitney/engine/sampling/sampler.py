"""Sampling: continuous batching over a cache of the running rows, per-request seeds, mixed adapters in one batch.

`Sampler` (one per base model) holds a queue and a running batch. `step()` admits queued requests
that fit the memory limits (prefilling each prompt once and copying its cache into `num_samples`
rows), then runs one decode step for every running row; a finished sequence leaves at once. The
caller decides when to step, so training and sampling interleave at decode-step granularity.

The cache of the running rows is the one part that differs between families: a strategy picked by the base
model's `decode_cache` (families/decoder.py), with the methods of `RowCache`:
  kv_cache.KVRows         a fast family's KVCache: every row in one ragged cache
  hf_sampler.ModelRows    a general-path model's own cache: rows in batches aligned on the right
Everything else (admission, prefill, choice, stops, results, failures) is this module's, for both.

Failures: a request whose own work fails (its prefill, its next-token choice, its stop check) gets
the exception in `error` and leaves the batch alone; the others go on unchanged (their generators are
drawn exactly as if it had never been there). A failing prompt pass of several requests is redone one request
at a time. A failing decode pass is the strategy's to handle: the model's own cache redoes it request by
request; the KV cache raises.

Log-probs: each generated token's log-prob is log_softmax(logits) of the model at temperature 1,
whatever the request's temperature, top_k or top_p: the same number `compute_logprobs` and a
training `forward` give for that token, which is what an importance ratio against the learner needs.

Cancelling: `cancel(request)` drops a request between steps (a client gone, a cancelled operation): out of the
queue, or its rows and their cache out of the batch at once, so no decode step runs for it again.

Streaming: a request submitted with `stream` keeps the tokens (and log-probs) its rows chose since the last
`take_progress()`, for a caller to hand on while it runs; the final `result` holds every token either way.

Devices: the cache, the batch and every choice live on the base model's device; each row's generator
is a CPU generator on every device (one float64 uniform per row per token, copied to the device as one
[B] tensor): a CUDA generator would cost a kernel and a synchronisation per row per step, and the CPU
one draws the same uniforms whatever the device.

Shape legend: B running rows, R prompts of one prompt pass, P prompt length, D hidden, V vocabulary.
"""

from __future__ import annotations

import math
import random
from typing import Protocol

import torch

from whitney.engine.families import vision
from whitney.engine.families.decoder import BaseModel, DecodeCache, full_logprobs
from whitney.engine.families.lora import Adapter, RowGroups
from whitney.engine.sampling.hf_sampler import ModelRows
from whitney.engine.sampling.kv_cache import KVRows
from whitney.engine.sampling.prompt_scores import score_prompt
from whitney.engine.sampling.rows import Row, SampleRequest, adapter_groups
from whitney.errors import check
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampledSequence, SampleResult, SamplingParams, validate


def _draws(p: SamplingParams) -> bool:
    """Whether a row samples (one uniform per token) rather than taking the argmax."""
    return p.temperature > 0 and p.top_k != 1


def uniforms(rows: list[Row]) -> torch.Tensor:
    """[B] float64 on the CPU: one uniform in [0, 1) from each sampling row's own generator; greedy rows draw
    none (0)."""
    return torch.tensor([torch.rand(1, generator=r.generator, dtype=torch.float64, device="cpu").item()
                         if _draws(r.request.params) else 0.0 for r in rows], dtype=torch.float64, device="cpu")


def next_tokens(logits: torch.Tensor, rows: list[Row], u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Choose the next token of each row from logits [B, V] with that row's own settings and uniform u [B].

    Greedy rows (temperature 0 or top_k 1) take the argmax. The others are sampled together: scale by
    temperature, keep each row's top_k and top_p nucleus, then invert the row's CDF at the row's
    uniform (drawn from its own generator by `uniforms`), so a row's choice never depends on the rest
    of the batch. Returns tokens [B] and their log-probs [B] under log_softmax(logits) (temperature 1),
    on the logits' device.
    """
    dev = logits.device
    logprobs = full_logprobs(logits)  # [B, V]
    chosen = torch.argmax(logits, dim=-1)  # [B]
    params = [r.request.params for r in rows]
    sampled = [b for b, p in enumerate(params) if _draws(p)]
    if sampled:
        idx = torch.tensor(sampled, device=dev)
        scores = logits.float() if len(sampled) == len(rows) else logits[idx].float()  # [S, V]
        temps = torch.tensor([params[b].temperature for b in sampled], dtype=torch.float32, device=dev)
        # Max subtracted first so that a tiny temperature cannot overflow to inf.
        scores = scores - scores.max(-1, keepdim=True).values
        if bool((temps != 1).any()):
            scores = scores / temps.clamp(min=1e-30)[:, None]
        ks = torch.tensor([params[b].top_k if params[b].top_k > 1 else 0 for b in sampled], device=dev)
        if bool((ks > 0).any()):
            top = torch.topk(scores, int(ks.max()), dim=-1).values  # [S, kmax]
            kth = top.gather(1, (ks - 1).clamp(min=0)[:, None])  # [S, 1]
            kth = torch.where(ks[:, None] > 0, kth, torch.full_like(kth, -math.inf))
            scores = scores.masked_fill(scores < kth, -math.inf)
        probs = torch.softmax(scores, dim=-1).double()  # [S, V]
        top_ps = torch.tensor([params[b].top_p for b in sampled], dtype=torch.float64, device=dev)
        if bool((top_ps < 1).any()):
            sorted_p, order = torch.sort(probs, dim=-1, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
            drop = (torch.cumsum(sorted_p, -1) - sorted_p) >= top_ps[:, None]
            probs = probs.scatter(1, order, sorted_p.masked_fill(drop, 0.0))
        cdf = torch.cumsum(probs, dim=-1)  # [S, V], unnormalised: u is scaled to each row's total instead
        u = u.to(dev)[idx]  # [S]
        # right=True: the first token whose cumulative mass exceeds u; a zero-probability token never is.
        picks = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0].clamp(max=logits.shape[-1] - 1)
        chosen[idx] = picks
    return chosen, logprobs.gather(1, chosen[:, None])[:, 0]


class RowCache(Protocol):
    """The cache of a sampler's running rows (row b of the sampler is row b of the cache): one strategy per
    `DecodeCache` kind, in `CACHES`."""

    @property
    def rows(self) -> int: ...

    def prefill_passes(self, requests: list[SampleRequest]) -> list[list[SampleRequest]]:
        """The requests (in order) whose prompts share one prompt pass."""

    def prefill(self, tokens: torch.Tensor, groups: RowGroups, images: list[list]) -> tuple[torch.Tensor, object]:
        """Hidden states [R, P, D] of right-padded prompts [R, P] (row r with groups' adapter and images[r]), and
        their cache (for `add`)."""

    def add(self, prefilled: object, copies: list[int], lengths: list[int]) -> None:
        """New rows after the running ones: row i caches prompt copies[i] of `prefilled`, lengths[i] tokens."""

    def decode(self, tokens: torch.Tensor, rows: list[Row]) -> torch.Tensor:
        """Hidden states [B, D] of every row's next token [B], each row cached one token further."""

    def keep(self, rows: torch.Tensor) -> None:
        """Keep only these rows (finished sequences leave)."""

    def settle(self) -> None:
        """Tidy up after an admission or a step (the model's own cache merges its batches)."""


CACHES: dict[DecodeCache, type] = {DecodeCache.KV: KVRows, DecodeCache.MODEL: ModelRows}


class Sampler:
    """The running batch and the queue of one base model. Drive it with `step()` until idle."""

    def __init__(self, base: BaseModel, max_sequences: int = EngineConfig.max_sequences,
                 max_cached_tokens: int = EngineConfig.max_cached_tokens,
                 max_prefill_tokens: int = EngineConfig.max_prefill_tokens):
        self.base = base
        self.max_sequences = max_sequences
        self.max_cached_tokens = max_cached_tokens
        # Prompt tokens prefilled in one step (at least one request): many long prompts arriving at once
        # are admitted over several steps, so one step never holds the caller for long.
        self.max_prefill_tokens = max_prefill_tokens
        self.queue: list[SampleRequest] = []
        self.rows: list[Row] = []
        self.cache: RowCache = CACHES[base.decode_cache](base)
        self.device = base.device  # the cache, the batch and the choices; generators stay on the CPU
        self._pending_tokens = torch.zeros(0, dtype=torch.int64, device=self.device)  # [B] last sampled, not cached
        self._top: dict[int, list[tuple[int, float]]] = {}  # the last _choose's rows' top alternatives, if asked

    def submit(self, prompt: list[int], params: SamplingParams, adapter: Adapter | None) -> SampleRequest:
        """Validate and queue a request; it runs on the next steps. Excess requests wait, never fail."""
        prompt, images = vision.expander(self.base).flatten(prompt, None)  # image chunks: placeholder positions
        validate(prompt, params, self.base.config, self.max_sequences)
        stop = params.stop
        request = SampleRequest(list(prompt), params, adapter, images=images)
        if stop is None:
            request.stop_ids = set(self.base.eos_token_ids)
        else:
            for s in stop:
                if isinstance(s, str):
                    request.stop_strs.append(s)
                elif isinstance(s, int):
                    request.stop_ids.add(s)
                else:
                    request.stop_seqs.append(list(s))
        check(request.reserved_tokens <= self.max_cached_tokens, f"num_samples x (prompt + max_tokens) = "
              f"{request.reserved_tokens} tokens exceeds this server's cache of {self.max_cached_tokens}",
              field="max_tokens")
        self.queue.append(request)
        return request

    @property
    def idle(self) -> bool:
        return not self.queue and not self.rows

    def cancel(self, request: SampleRequest) -> bool:
        """Drop a request now (its client went away, or cancelled it): out of the queue, or its rows out of the
        batch with their cache, so the next decode step runs without them; the other rows go on unchanged (their
        generators, tokens and cache rows as before). Whether this sampler held it."""
        queued = [r for r in self.queue if r is not request]
        if len(queued) < len(self.queue):
            self.queue = queued
            request.cancelled = True  # done: whatever held on for it (a run kept in memory) lets go
            return True
        keep = [b for b, row in enumerate(self.rows) if row.request is not request]
        if len(keep) == len(self.rows):
            return False
        request.cancelled = True
        index = torch.tensor(keep, dtype=torch.int64, device=self.device)
        self.rows = [self.rows[b] for b in keep]
        self.cache.keep(index)  # the cache rows go with them: their memory is freed
        self._pending_tokens = self._pending_tokens[index]
        self.cache.settle()
        return True

    def step(self) -> None:
        """Admit what fits, then one decode step for every running row."""
        with torch.no_grad():
            self._admit()
            if self.rows:
                self._decode()

    def _reserved(self) -> int:
        return sum(len(r.request.prompt) + r.request.params.max_tokens for r in self.rows)

    def _admit(self) -> None:
        admitted, rows, tokens, prefill = [], len(self.rows), self._reserved(), 0
        while self.queue:
            req = self.queue[0]
            if (rows + req.params.num_samples > self.max_sequences
                    or tokens + req.reserved_tokens > self.max_cached_tokens):
                break
            if admitted and prefill + len(req.prompt) > self.max_prefill_tokens:
                break
            admitted.append(self.queue.pop(0))
            rows, tokens = rows + req.params.num_samples, tokens + req.reserved_tokens
            prefill += len(req.prompt)
        if admitted:
            for requests in self.cache.prefill_passes(admitted):
                self._prefill(requests)
            self.cache.settle()

    def _prefill(self, requests: list[SampleRequest]) -> None:
        """Run the prompts in one pass; copy each one's cache into num_samples rows; sample each row's first token.

        If the shared prompt pass fails, each request is prefilled alone, so only the one whose own pass
        fails gets the error. A request failing in its own unembedding or prompt log-probs gets the error
        and no rows; one failing its first choice gets the error and its rows leave at once (_record). The
        others are admitted as if it had not been there.
        """
        groups = RowGroups([(i, i + 1, r.adapter) for i, r in enumerate(requests)])
        try:
            hidden, prefilled = self._prompt_pass(requests, groups)  # [R, P, D]
        except Exception as e:
            if len(requests) == 1:
                requests[0].error = e
            else:
                for r in requests:
                    self._prefill([r])
            return
        admitted = self._first_tokens(requests, hidden)
        if admitted is None:
            return
        rows, copies, chosen, lps = admitted
        self.cache.add(prefilled, copies, [len(requests[i].prompt) for i in copies])
        self._add_rows(rows, chosen, lps)

    def _prompt_pass(self, requests: list[SampleRequest], groups: RowGroups) -> tuple[torch.Tensor, object]:
        """The requests' prompts, right-padded into [R, P], through the cache's prefill: hidden states [R, P, D]
        and the prompts' cache."""
        P = max(len(r.prompt) for r in requests)
        tokens = torch.zeros(len(requests), P, dtype=torch.int64, device="cpu")
        for i, r in enumerate(requests):
            tokens[i, : len(r.prompt)] = torch.tensor(r.prompt, dtype=torch.int64, device="cpu")
        tokens = tokens.to(self.device)  # filled on the CPU, one copy to the device
        return self.cache.prefill(tokens, groups, [r.images for r in requests])

    def _first_tokens(self, requests: list[SampleRequest], hidden: torch.Tensor):
        """From the prompts' hidden states [R, P, D] (right-padded): prompt scores when asked, and (rows, the prompt
        each row copies its cache row from, first tokens [n], their log-probs [n]), or None if no request is
        admitted. A request failing its unembedding or prompt scores gets the error and no rows."""
        new_rows, first_logits, copies = [], [], []
        for i, r in enumerate(requests):
            n, p = r.params.num_samples, len(r.prompt)
            want_all = r.params.scores_prompt
            try:
                h = hidden[i, :p] if want_all else hidden[i, p - 1:p]
                logits = self.base.unembed(h, RowGroups([(0, h.shape[0], r.adapter)]))  # [p or 1, V]
                r.result = SampleResult([None] * n)
                if want_all:
                    self._prompt_logprobs(r, logits)
            except Exception as e:
                r.error = e
                continue
            first_logits.append(logits[-1:].expand(n, -1))
            seed = r.params.seed if r.params.seed is not None else random.getrandbits(63)
            for s in range(n):
                gen = torch.Generator(device="cpu").manual_seed((seed + 0x9E3779B97F4A7C15 * s) % 2**63)
                new_rows.append(Row(r, s, gen))
            copies += [i] * n
            r.pending = n
        if not new_rows:
            return None
        chosen, lps = self._choose(torch.cat(first_logits), new_rows)
        return new_rows, copies, chosen, lps

    def _add_rows(self, rows: list[Row], chosen: torch.Tensor, lps: torch.Tensor) -> None:
        """Append admitted rows after their cache rows and record their first tokens (a failed choice leaves)."""
        self.rows += rows
        self._pending_tokens = torch.cat([self._pending_tokens, chosen])
        self._record(len(self.rows) - len(rows), chosen, lps)

    def _prompt_logprobs(self, r: SampleRequest, logits: torch.Tensor) -> None:
        """The prompt's scores (prompt_scores.score_prompt) from its logits [P, V], into the result."""
        res = r.result
        res.prompt_logprobs, res.topk_prompt_logprobs, res.target_prompt_logprobs = score_prompt(r.prompt, r.params,
                                                                                                 logits)
        for im in r.images:  # the model predicts no image: its positions score None (as compute_logprobs)
            for scores in (res.prompt_logprobs, res.topk_prompt_logprobs):
                if scores is not None:
                    scores[im.start:im.start + im.tokens] = [None] * im.tokens

    def _decode(self) -> None:
        """One token for every running row: the cache's decode pass, then one choice for all rows."""
        hidden = self.cache.decode(self._pending_tokens, self.rows)  # [B, D]
        logits = self.base.unembed(hidden, adapter_groups(self.rows, self.device))  # [B, V]
        chosen, lps = self._choose(logits, self.rows)
        self._pending_tokens = chosen
        self._record(0, chosen, lps)
        self.cache.settle()

    def _choose(self, logits: torch.Tensor, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """next_tokens for all rows at once. If that fails, each request's rows alone with the same
        uniforms: a request whose choice fails gets the error (its rows leave in _record), and every
        other row's token is what it would have been."""
        u = uniforms(rows)  # [B], drawn once, so a retry leaves every generator where it was
        self._top = _top_logprobs(logits, rows)
        try:
            return next_tokens(logits, rows, u)
        except Exception:
            by_request: dict[int, list[int]] = {}
            for b, row in enumerate(rows):
                by_request.setdefault(id(row.request), []).append(b)
            dev = logits.device
            chosen = torch.zeros(len(rows), dtype=torch.int64, device=dev)
            lps = torch.zeros(len(rows), device=dev)
            for idx in by_request.values():
                index = torch.tensor(idx, device=dev)
                try:
                    chosen[index], lps[index] = next_tokens(logits[index], [rows[b] for b in idx], u[idx])
                except Exception as e:
                    rows[idx[0]].request.error = e
            return chosen, lps

    def _record(self, first: int, chosen: torch.Tensor, lps: torch.Tensor) -> None:
        """Append the new tokens of rows[first:]; rows that finished, and rows of a request that failed
        (its error set), leave the batch."""
        keep = list(range(first))
        for b, (token, lp) in enumerate(zip(chosen.tolist(), lps.tolist()), start=first):
            row = self.rows[b]
            if row.request.error is not None:
                continue
            row.tokens.append(token)
            row.logprobs.append(lp)
            top = self._top.get(b - first)
            if top is not None:
                row.top_logprobs.append(top)
            if row.request.stream:
                row.request.note(row.index, token, lp, top)
            try:
                reason = self._stop_reason(row)
            except Exception as e:  # e.g. the tokenizer on this row's tokens: this request alone fails
                row.request.error = e
                continue
            if reason is None:
                keep.append(b)
                continue
            # Samples keep their index order whatever order they finish in.
            row.request.result.sequences[row.index] = SampledSequence(
                row.tokens, row.logprobs, reason, row.top_logprobs if row.request.params.top_logprobs else None)
            row.request.pending -= 1
        keep = [b for b in keep if self.rows[b].request.error is None]  # a request failing above: all its rows
        if len(keep) < len(self.rows):
            index = torch.tensor(keep, dtype=torch.int64, device=self.device)
            self.rows = [self.rows[i] for i in keep]
            self.cache.keep(index)
            self._pending_tokens = self._pending_tokens[index]

    def _stop_reason(self, row: Row) -> str | None:
        req, tokens = row.request, row.tokens
        if tokens[-1] in req.stop_ids or any(tokens[-len(s):] == s for s in req.stop_seqs):
            return "stop"
        if req.stop_strs:
            # Checked after every token, so the first appearance stops, even one ending inside a token.
            text = self.base.tokenizer.decode(tokens)
            if any(s in text for s in req.stop_strs):
                return "stop"
        if len(tokens) >= req.params.max_tokens:
            return "length"
        return None


def _top_logprobs(logits: torch.Tensor, rows: list[Row]) -> dict[int, list[tuple[int, float]]]:
    """For each row b whose request asks for top_logprobs k: the k most likely (token, log-prob) under
    log_softmax(logits[b]) (temperature 1, as every reported log-prob). logits: [B, V]."""
    want = [b for b, r in enumerate(rows) if r.request.params.top_logprobs > 0]
    if not want:
        return {}
    k = max(rows[b].request.params.top_logprobs for b in want)
    index = torch.tensor(want, device=logits.device)
    top = torch.topk(full_logprobs(logits[index]), k, dim=-1)  # [W, k]
    ids, values = top.indices.tolist(), top.values.tolist()
    return {b: list(zip(ids[i], values[i]))[:rows[b].request.params.top_logprobs] for i, b in enumerate(want)}
