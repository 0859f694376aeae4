"""A Whitney sampling request as vLLM's /v1/completions request, and vLLM's answer back as Whitney's result.

What vLLM cannot do exactly as Whitney's contract says is never sent to it: `exact_only` names the reason, and
the request goes to Whitney's own sampler instead (backend.py). Everything else maps one to one:

    num_samples -> n            temperature, top_k (-1/0: off), top_p, seed, max_tokens -> the same
    stop None -> stop_token_ids: the model's EOS ids    stop strings -> stop    stop token ids -> stop_token_ids
    (always with ignore_eos: vLLM adds no stop of its own)
    top_logprobs k -> logprobs k (vLLM lists the chosen token first, then the k most likely: sorted, cut to k)

Token ids travel as ids both ways (`return_tokens_as_token_ids`: "token_id:N" strings), so no text is decoded
and re-encoded. vLLM's log-probs are of the model's raw distribution (its default `--logprobs-mode`), which is
what Whitney's are: temperature 1, before top-k and top-p.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from whitney.protocol.backend import ExactOnly
from whitney.protocol.sampling import SampledSequence, SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import ImageInput


def exact_only(prompt: list, params: SamplingParams, max_model_len: int) -> ExactOnly | None:
    """Why Whitney's own sampler must serve this request (None: vLLM serves it exactly as asked)."""
    if any(isinstance(c, ImageInput) for c in prompt):
        return ExactOnly.IMAGES
    if params.target_prompt_logprobs is not None:
        return ExactOnly.TARGET_LOGPROBS
    if params.scores_prompt:
        return ExactOnly.PROMPT_LOGPROBS
    stops = params.stop or ()
    if any(isinstance(s, (list, tuple)) and len(s) > 1 for s in stops):
        return ExactOnly.STOP_SEQUENCES
    if len(flat(prompt)) + params.max_tokens > max_model_len:
        return ExactOnly.LONG
    return None


def completion_body(prompt: list[int], params: SamplingParams, model: str, eos_token_ids: tuple[int, ...]
                    ) -> dict:
    """vLLM's /v1/completions body for the request, streamed: a cancel closes the connection, which aborts the
    request there."""
    body = {"model": model, "prompt": flat(prompt), "max_tokens": params.max_tokens, "n": params.num_samples,
            "temperature": float(params.temperature), "top_p": float(params.top_p),
            "top_k": params.top_k if params.top_k > 0 else -1, "logprobs": max(params.top_logprobs, 1),
            "return_tokens_as_token_ids": True, "skip_special_tokens": False, "stream": True}
    if params.seed is not None:
        body["seed"] = params.seed
    # EOS stops only as Whitney's contract says (stop None: the model's EOS ids), never by vLLM's own defaults.
    body["ignore_eos"] = True
    stops = list(params.stop) if params.stop is not None else list(eos_token_ids)
    strings = [s for s in stops if isinstance(s, str)]
    ids = [s if isinstance(s, int) else s[0] for s in stops if not isinstance(s, str)]
    if strings:
        body["stop"] = strings
    if ids:
        body["stop_token_ids"] = ids
    return body


def flat(prompt: list) -> list[int]:
    """A prompt's token ids (chunks of token ids joined)."""
    return [t for c in prompt for t in (c if isinstance(c, (list, tuple)) else (c,))]


def token_id(text: str) -> int:
    """vLLM's "token_id:N" (return_tokens_as_token_ids) as N."""
    return int(text.rsplit(":", 1)[1])


@dataclass
class Sample:
    """One of a request's samples as its stream arrives."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    reported: int = 0  # tokens already handed on as progress


@dataclass
class Answer:
    """A request's answer as vLLM streams it: each sample's tokens, log-probs and end."""

    params: SamplingParams
    samples: list[Sample]

    @classmethod
    def of(cls, params: SamplingParams) -> "Answer":
        return cls(params, [Sample() for _ in range(params.num_samples)])

    def add(self, chunk: dict) -> None:
        """One streamed chunk: each choice's new tokens (ids as "token_id:N"), their log-probs and alternatives."""
        for choice in chunk.get("choices", ()):
            sample = self.samples[choice.get("index", 0)]
            logprobs = choice.get("logprobs") or {}
            for i, text in enumerate(logprobs.get("tokens") or ()):
                sample.tokens.append(token_id(text))
                sample.logprobs.append(float(logprobs["token_logprobs"][i]))
                top = (logprobs.get("top_logprobs") or [None] * (i + 1))[i] or {}
                sample.top.append(sorted(((token_id(t), float(v)) for t, v in top.items()), key=lambda x: -x[1]))
            if choice.get("finish_reason") is not None:
                sample.finish_reason = choice["finish_reason"]

    def progress(self) -> SampleProgress | None:
        """The tokens chosen since the last call (None when there are none)."""
        new = [(s.tokens[s.reported:], s.logprobs[s.reported:], s.top[s.reported:]) for s in self.samples]
        if not any(tokens for tokens, _, _ in new):
            return None
        for s in self.samples:
            s.reported = len(s.tokens)
        k = self.params.top_logprobs
        return SampleProgress([t for t, _, _ in new], [lp for _, lp, _ in new],
                              [[alts[:k] for alts in top] for _, _, top in new] if k else None)

    def result(self) -> SampleResult:
        """The whole answer in Whitney's shape (stop_reason "length" when max_tokens ended it, else "stop")."""
        k = self.params.top_logprobs
        sequences = [SampledSequence(s.tokens, s.logprobs, "length" if s.finish_reason == "length" else "stop",
                                     [alts[:k] for alts in s.top] if k else None) for s in self.samples]
        return SampleResult(sequences)
