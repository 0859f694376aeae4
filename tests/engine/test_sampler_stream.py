"""Streaming progress and top log-probs of generated tokens, on both samplers: the fast path's `Sampler` and
the general path's model cache (`hf_sampler.ModelRows`): both come from the one sampler core.

References: the request's own final result (progress reports joined must equal it), the full forward's
logits (top log-probs), and the same request without streaming or top log-probs (neither may change a
single token)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_sampler import ref_logits
from tests.models import make_tiny_general_model
from whitney.backends.in_process import InProcessBackend
from whitney.engine import Engine
from whitney.engine.families.decoder import full_logprobs
from whitney.engine.sampling.hf_sampler import ModelRows
from whitney.protocol.backend import Weights
from whitney.protocol.sampling import SampleProgress, SampleResult, SamplingParams

PROMPT = [1, 873, 2201, 5120, 40, 777]


@pytest.fixture(scope="module")
def mistral(tmp_path_factory) -> str:
    return str(make_tiny_general_model(tmp_path_factory.mktemp("stream") / "tiny-mistral", "mistral"))


@pytest.fixture(params=["fast", "general"])
def model(request, tiny_llama, mistral) -> str:
    return tiny_llama if request.param == "fast" else mistral


def run(backend: InProcessBackend, model: str, params: SamplingParams, stream: bool):
    """Submit one request, step it to its end: the progress reports and the result."""
    backend.submit_sample("r", PROMPT, params, Weights(base_model=model), stream=stream)
    reports, result = [], None
    while result is None:
        for request_id, outcome in backend.sample_step():
            assert request_id == "r"
            if isinstance(outcome, SampleProgress):
                assert result is None, "progress after the end"
                reports.append(outcome)
            else:
                assert isinstance(outcome, SampleResult), outcome
                result = outcome
    return reports, result


def test_progress_reports_join_up_to_the_result_and_change_nothing(model):
    backend = InProcessBackend(Engine())
    backend.load_model(model)
    params = SamplingParams(max_tokens=12, temperature=0.9, seed=4, num_samples=2, stop=(), top_logprobs=3)
    reports, result = run(backend, model, params, stream=True)
    sampler = next(iter(backend.engine.samplers.values()))
    assert isinstance(sampler.cache, ModelRows) == (model.endswith("mistral"))
    assert len(reports) >= 10, "a report per step, not one at the end"
    for i, seq in enumerate(result.sequences):
        streamed = [t for r in reports for t in r.tokens[i]]
        assert streamed == seq.tokens[:len(streamed)] and len(streamed) >= len(seq.tokens) - 1
        assert [lp for r in reports for lp in r.logprobs[i]] == seq.logprobs[:len(streamed)]
        assert [t for r in reports for t in r.top_logprobs[i]] == seq.top_logprobs[:len(streamed)]

    _, plain = run(backend, model, SamplingParams(max_tokens=12, temperature=0.9, seed=4, num_samples=2, stop=()),
                   stream=False)
    assert [s.tokens for s in plain.sequences] == [s.tokens for s in result.sequences]
    assert [s.logprobs for s in plain.sequences] == [s.logprobs for s in result.sequences]
    assert all(s.top_logprobs is None for s in plain.sequences)


def test_top_logprobs_are_the_full_forwards_top_k(model):
    backend = InProcessBackend(Engine())
    base = backend.engine.load_model(model)
    _, result = run(backend, model, SamplingParams(max_tokens=6, temperature=0.0, stop=(), top_logprobs=4),
                    stream=False)
    (seq,) = result.sequences
    logits = ref_logits(base, None, PROMPT + seq.tokens)[len(PROMPT) - 1:-1]  # [6, V]
    top = torch.topk(full_logprobs(logits), 4, dim=-1)
    for position, alternatives in enumerate(seq.top_logprobs):
        assert [t for t, _ in alternatives] == top.indices[position].tolist()
        assert [lp for _, lp in alternatives] == pytest.approx(top.values[position].tolist(), abs=1e-4)
        assert alternatives[0][0] == seq.tokens[position]  # greedy: the most likely one was taken
