"""What a sampling request asks for (`SamplingParams`), its checks against a model (`validate`), and what it
gets back (`SampleResult`; a streaming request's `SampleProgress` as it goes). Torch-free: the control plane
checks a request before anything is queued.

A prompt is token ids, or chunks: token-id lists and images (protocol/training.py ImageInput). Before the engine has
expanded the images (the service's check) an image counts its `expected_tokens` (0 when not given), so the
checks that depend on the prompt's length are exact only on the engine's own call, after expansion.

Shape legend: P prompt length, K target ids per position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from whitney.errors import check
from whitney.protocol.training import ImageInput

MAX_TOPK_PROMPT_LOGPROBS = 100
MAX_TOP_LOGPROBS = 20  # the OpenAI routes' bound on alternatives per generated token (the engine's is the one above)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_k: int = -1  # -1 or 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None = a fresh random seed
    stop: tuple | None = None  # strings, token ids or token-id sequences; None = EOS; () = nothing
    num_samples: int = 1
    prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    top_logprobs: int = 0  # the k most likely tokens (and their log-probs) at each generated position
    prompt_logprobs_last_n: int | None = None  # score only the last n prompt positions (earlier ones None)
    # [P-1, K] token ids: cell [i][j] is scored at prompt position i + 1; -1 asks for nothing.
    target_prompt_logprobs: tuple[tuple[int, ...], ...] | None = None

    @property
    def scores_prompt(self) -> bool:
        """Whether the prefill keeps logits at every prompt position (for prompt log-probs of any kind)."""
        return self.prompt_logprobs or self.topk_prompt_logprobs > 0 or self.target_prompt_logprobs is not None


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate(prompt: list[int], params: SamplingParams, model, max_samples: int) -> None:
    """Check every parameter of a request against the model (anything with `vocab_size` and `max_context`:
    a ModelConfig, or the service's ModelInfo), so nothing fails later in the batch; each rule names its
    parameter. Integers are never booleans; top_k and topk_prompt_logprobs are at most V."""
    vocab, context = model.vocab_size, model.max_context
    check(isinstance(prompt, list) and len(prompt) > 0, "prompt must be a non-empty list of token ids",
          field="prompt")
    if any(isinstance(c, (list, tuple, ImageInput)) for c in prompt):  # chunks
        check(all(isinstance(c, (list, tuple, ImageInput)) for c in prompt),
              "prompt chunks must be token-id lists or images", field="prompt")
        tokens = [t for c in prompt if not isinstance(c, ImageInput) for t in c]
        check(all(_int(t) and 0 <= t < vocab for t in tokens),
              f"prompt token ids must be integers in [0, {vocab})", field="prompt")
        positions = sum(c.expected_tokens or 0 for c in prompt if isinstance(c, ImageInput))
        check(len(tokens) + positions <= context, f"prompt ({len(tokens) + positions} positions) exceeds the "
              f"model's context of {context}", field="prompt")  # before a list that long is made
        prompt = tokens + [0] * positions
        check(len(prompt) > 0, "prompt must hold at least one token or image", field="prompt")
    check(all(_int(t) and 0 <= t < vocab for t in prompt),
          f"prompt token ids must be integers in [0, {vocab})", field="prompt")
    check(_int(params.max_tokens) and params.max_tokens >= 1,
          f"max_tokens must be a positive integer, got {params.max_tokens!r}", field="max_tokens")
    check(len(prompt) + params.max_tokens <= context, f"prompt ({len(prompt)} tokens) plus max_tokens "
          f"({params.max_tokens}) exceeds the model's context of {context}", field="max_tokens")
    t = params.temperature
    check(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0,
          f"temperature must be finite and >= 0, got {t!r}", field="temperature")
    check(_int(params.top_k) and -1 <= params.top_k <= vocab,
          f"top_k must be -1 or 0 (off) or from 1 to the vocabulary size {vocab}, got {params.top_k!r}",
          field="top_k")
    p = params.top_p
    check(isinstance(p, (int, float)) and not isinstance(p, bool) and math.isfinite(p) and 0 < p <= 1,
          f"top_p must be in (0, 1], got {p!r}", field="top_p")
    check(_int(params.num_samples) and 1 <= params.num_samples <= max_samples,
          f"num_samples must be from 1 to {max_samples}, got {params.num_samples!r}", field="num_samples")
    check(params.seed is None or (_int(params.seed) and 0 <= params.seed < 2**63),
          f"seed must be a non-negative integer below 2**63, got {params.seed!r}", field="seed")
    check(isinstance(params.prompt_logprobs, bool), f"prompt_logprobs must be true or false, got "
          f"{params.prompt_logprobs!r}", field="prompt_logprobs")
    k, k_max = params.topk_prompt_logprobs, min(MAX_TOPK_PROMPT_LOGPROBS, vocab)
    check(_int(k) and 0 <= k <= k_max,
          f"topk_prompt_logprobs must be from 0 to {k_max}, got {k!r}", field="topk_prompt_logprobs")
    k, k_max = params.top_logprobs, min(MAX_TOPK_PROMPT_LOGPROBS, vocab)
    check(_int(k) and 0 <= k <= k_max, f"top_logprobs must be from 0 to {k_max}, got {k!r}", field="top_logprobs")
    n = params.prompt_logprobs_last_n
    check(n is None or (_int(n) and 1 <= n <= len(prompt) - 1 and (params.prompt_logprobs or
                                                                     params.topk_prompt_logprobs > 0)),
          f"prompt_logprobs_last_n needs prompt_logprobs or topk_prompt_logprobs and must be from 1 to "
          f"len(prompt) - 1 = {len(prompt) - 1}, got {n!r}", field="prompt_logprobs_last_n")
    if params.target_prompt_logprobs is not None:
        validate_targets(params.target_prompt_logprobs, len(prompt), vocab, MAX_TOPK_PROMPT_LOGPROBS)
    check(params.stop is None or isinstance(params.stop, (list, tuple)),
          f"stop must be a list of strings, token ids or token-id lists, got {params.stop!r}", field="stop")
    for s in params.stop or ():
        ok = (isinstance(s, str) and s != "") or (_int(s) and 0 <= s < vocab) or (
            isinstance(s, (list, tuple)) and len(s) > 0 and all(_int(x) and 0 <= x < vocab for x in s))
        check(ok, f"each stop must be a non-empty string, a token id in [0, {vocab}) or a non-empty list of them, "
              f"got {s!r}", field="stop")


def validate_targets(targets, prompt_len: int, vocab: int, max_width: int) -> None:
    """target_prompt_logprobs: exactly P-1 rows of one width K from 1 to `max_width` (the prompt top-k bound,
    so the cost stays P x K), ids -1 or in [0, V), at least one id."""
    field = "target_prompt_logprobs"
    check(isinstance(targets, (list, tuple)) and len(targets) == prompt_len - 1 and
          all(isinstance(r, (list, tuple)) for r in targets),
          f"{field} must have len(prompt) - 1 = {prompt_len - 1} rows", field=field)
    width = len(targets[0]) if targets else 0
    check(1 <= width <= max_width and all(len(r) == width for r in targets),
          f"{field} rows must all have one width from 1 to {max_width}", field=field)
    check(all(_int(t) and -1 <= t < vocab for r in targets for t in r),
          f"{field} ids must be integers in [0, {vocab}) or -1 (nothing asked)", field=field)
    check(any(t >= 0 for r in targets for t in r), f"{field} must name at least one token id", field=field)


@dataclass
class SampledSequence:
    tokens: list[int]
    logprobs: list[float]  # [len(tokens)] log-prob of each generated token at temperature 1
    stop_reason: str  # "stop" | "length"
    top_logprobs: list[list[tuple[int, float]]] | None = None  # [len(tokens)] of k (token, logprob), if asked


@dataclass
class SampleProgress:
    """A streaming request's tokens chosen since its last report, per sample ([num_samples] lists, some
    maybe empty), with their log-probs and (if asked) their top alternatives."""

    tokens: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[list[tuple[int, float]]]] | None = None

    def extend(self, later: "SampleProgress") -> None:
        """Append a later report of the same request to this one."""
        for mine, theirs in ((self.tokens, later.tokens), (self.logprobs, later.logprobs),
                             (self.top_logprobs, later.top_logprobs)):
            for a, b in zip(mine or (), theirs or ()):
                a.extend(b)


@dataclass
class SampleResult:
    sequences: list[SampledSequence]
    prompt_logprobs: list[float | None] | None = None  # [P], first None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None  # [P] of k (token, logprob)
    target_prompt_logprobs: list[list[float | None]] | None = None  # [P-1, K], None where the id was -1
