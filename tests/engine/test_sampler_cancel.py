"""Sampler.cancel (issue 31, item 10): a cancelled request leaves the queue, or its rows and their cache leave the
batch at once, and every other request decodes exactly what it would have without it (same tokens, same
log-probs), on both cache strategies: the fast families' KV cache and a general-path model's own cache."""

from __future__ import annotations

import pytest

from tests.models import make_tiny_general_model
from whitney.engine import Engine
from whitney.protocol.sampling import SamplingParams

KEPT = SamplingParams(max_tokens=12, temperature=1.0, seed=7, num_samples=2, stop=())
CANCELLED = SamplingParams(max_tokens=200, temperature=1.0, seed=8, num_samples=3, stop=())


@pytest.fixture(params=["llama", "mistral"], ids=["kv-cache", "model-cache"])
def model(request, tiny_llama, tmp_path_factory) -> str:
    if request.param == "llama":
        return tiny_llama
    return str(make_tiny_general_model(tmp_path_factory.mktemp("cancel") / "mistral", "mistral"))


def tokens(request) -> list[tuple[list[int], list[float]]]:
    return [(s.tokens, s.logprobs) for s in request.result.sequences]


def test_a_cancelled_request_leaves_the_batch_with_its_cache(model):
    alone = Engine()
    reference = alone.submit_sample([1, 5, 9], KEPT, base_model=model)
    while not reference.done:
        alone.sample_step()

    engine = Engine()
    kept = engine.submit_sample([1, 5, 9], KEPT, base_model=model)
    dropped = engine.submit_sample([1, 30, 4000], CANCELLED, base_model=model)
    engine.sample_step()  # both admitted (2 + 3 rows), one token each
    (sampler,) = engine.samplers.values()
    assert len(sampler.rows) == 5 and sampler.cache.rows == 5
    engine.sample_step()
    assert sampler.cancel(dropped) is True and dropped.done, "done: nothing holds on for it (a run kept in memory)"
    assert len(sampler.rows) == 2 and all(row.request is kept for row in sampler.rows) and sampler.cache.rows == 2
    assert sampler._reserved() == KEPT.num_samples * (3 + KEPT.max_tokens), "its cache tokens are released"
    assert sampler.cancel(dropped) is False  # gone already
    steps = 0
    while not kept.done:
        engine.sample_step()
        steps += 1
        assert all(row.request is kept for row in sampler.rows), "the cancelled request never decodes again"
    for (got, got_lps), (want, want_lps) in zip(tokens(kept), tokens(reference), strict=True):
        assert got == want, "the other request decodes as if the cancelled one had not been there"
        assert got_lps == pytest.approx(want_lps, abs=1e-5)
    assert sampler.idle and sampler.cache.rows == 0 and 0 < steps < KEPT.max_tokens


def test_a_queued_request_is_cancelled_before_it_is_admitted(tiny_llama):
    engine = Engine(max_sequences=2)
    running = engine.submit_sample([1, 5], SamplingParams(max_tokens=4, num_samples=2, stop=()), base_model=tiny_llama)
    waiting = engine.submit_sample([1, 6], SamplingParams(max_tokens=4, num_samples=2, stop=()), base_model=tiny_llama)
    engine.sample_step()
    (sampler,) = engine.samplers.values()
    assert len(sampler.queue) == 1 and sampler.queue[0] is waiting
    assert sampler.cancel(waiting) is True and sampler.queue == [] and waiting.done
    while not running.done:
        engine.sample_step()
    assert sampler.idle and waiting.result is None, "never admitted, never prefilled"
