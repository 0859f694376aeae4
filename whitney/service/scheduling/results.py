"""The backend's results as the store keeps them and the wire shows them: plain data (lists, numbers,
strings), converted here once."""

from __future__ import annotations

from enum import StrEnum

from whitney.protocol.sampling import SampleResult
from whitney.protocol.training import ForwardResult


class StopReason(StrEnum):
    """Why a sampled sequence ended (`SampledSequence.stop_reason`; OpenAI's finish_reason takes the same names)."""

    STOP = "stop"  # a stop token or stop sequence
    LENGTH = "length"  # max_tokens, or the context's end


def forward_result_dict(result: ForwardResult) -> dict:
    return {
        "loss": result.loss,
        "metrics": result.metrics,
        "outputs": [{"logprobs": o.logprobs, "elementwise_loss": o.elementwise_loss} for o in result.outputs],
    }


def sample_result_dict(result: SampleResult) -> dict:
    return {
        "sequences": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                      for s in result.sequences],
        "prompt_logprobs": result.prompt_logprobs,
        "topk_prompt_logprobs": result.topk_prompt_logprobs,
        "target_prompt_logprobs": result.target_prompt_logprobs,
    }


def sample_result(result: SampleResult) -> dict:
    """A sample's stored result: `sample_result_dict`, with each sequence's top_logprobs where asked for."""
    out = sample_result_dict(result)
    for wire, sequence in zip(out["sequences"], result.sequences):
        if sequence.top_logprobs is not None:
            wire["top_logprobs"] = sequence.top_logprobs
    return out

