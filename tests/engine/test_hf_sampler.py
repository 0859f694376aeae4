"""Cross-request batching in the general path's sampler (engine/hf_sampler.py): requests of different prompt
lengths, adapters and settings decode in one forward of the model, and each request's seeded tokens and
log-probs are what it gets alone."""

from __future__ import annotations

import pytest
import torch

from tests.models import GENERAL_KINDS, make_tiny_general_model
from whitney.engine import Engine, LoraConfig
from whitney.engine.sampling import hf_sampler
from whitney.protocol.sampling import SamplingParams

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("hf_sampler"), {}

    def get(kind: str) -> str:
        if kind not in made:
            made[kind] = str(make_tiny_general_model(root / kind, kind))
        return made[kind]

    return get


def _engine_with_runs(path: str) -> tuple[Engine, list[dict]]:
    """A fresh engine with two runs of different adapters (non-zero B), as sampling weights."""
    engine = Engine(device="cpu", compute_dtype="float32")
    weights = []
    for seed in (1, 2):
        run_id = f"run{seed}"
        engine.create_run(run_id, path, LoraConfig(rank=2 + seed, alpha=4.0, seed=seed))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for b in engine.get_run(run_id).adapter.B.values():
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
        weights.append(dict(run_id=run_id, version=engine.save_weights_for_sampler(run_id)))
    return engine, weights


def _jobs(path: str, weights: list[dict]) -> list[tuple]:
    """Three requests: different prompt lengths (9, 4 and 13 tokens, all longer than the sliding windows of the
    tiny gemma3_text and gpt_oss), adapters, samples and settings.

    Each samples among its top_k tokens: a tiny random model's next-token distribution is nearly flat over all
    49152 tokens, where a rounding difference of 1e-6 in the logits (4 rows in one pass are not computed bit for
    bit as 1 row) may move the inverted CDF onto a neighbouring token; among 20-50 tokens each holds ~2% of the
    mass, so only a real difference (a wrong position, mask, cache row or generator) changes a token."""
    g = torch.Generator().manual_seed(5)
    p = [torch.randint(100, 49152, (n,), generator=g).tolist() for n in (9, 4, 13)]
    return [(p[0], SamplingParams(max_tokens=8, top_k=40, seed=5, num_samples=2, stop=()), weights[0]),
            (p[1], SamplingParams(max_tokens=10, temperature=0.8, top_k=20, top_p=0.9, seed=7, stop=()), weights[1]),
            (p[2], SamplingParams(max_tokens=6, top_k=50, seed=11, stop=()), dict(base_model=path))]


def _assert_same(batched, alone) -> None:
    assert batched.error is None, batched.error
    assert [s.tokens for s in batched.result.sequences] == [s.tokens for s in alone.sequences]
    for x, y in zip(batched.result.sequences, alone.sequences):
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0)


def _count_decode_passes(engine: Engine, path: str) -> list[int]:
    """Rows of every one-token pass of the model's decoder from now on (a list that fills as it runs)."""
    rows: list[int] = []
    engine.load_model(path).decoder_stack.register_forward_hook(
        lambda _m, _args, kwargs, _out: rows.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[1] == 1 else None, with_kwargs=True)
    return rows


@pytest.mark.parametrize("kind", list(GENERAL_KINDS))
def test_seeded_requests_batched_equal_each_alone_in_one_pass_per_step(model_dirs, kind):
    """Requests joining a running batch at different steps, each sampled with its own seed, get the tokens and
    log-probs they get alone, and every decode step is one pass of the model over all running rows."""
    path = model_dirs(kind)
    engine, weights = _engine_with_runs(path)
    jobs = _jobs(path, weights)
    alone = [engine.sample(p, params, **w) for p, params, w in jobs]
    sampler = engine.samplers[engine.load_model(path).name]
    assert sampler.cache._may_pad(), f"{kind}: left-padded rows do not decode as each alone"
    passes = _count_decode_passes(engine, path)

    pending = [engine.submit_sample(p, params, **w) for p, params, w in jobs[:2]]
    steps = 0
    while engine.sample_step():
        steps += 1
        if steps == 2:  # the longest prompt joins rows already two tokens in
            pending.append(engine.submit_sample(*jobs[2][:2], **jobs[2][2]))
        batches = sampler.cache.batches
        assert len(batches) <= 1, "all running rows are in one batch"
        if batches:  # no position is padding in every row (the positions of rows that left are cut)
            assert batches[0].span == max(batches[0].lengths) and batches[0].rows == len(sampler.rows)
    for b, a in zip(pending, alone):
        _assert_same(b, a)
    assert len(passes) == steps and max(passes) == 4  # 2 samples + 1 + 1 rows in one pass
    assert alone[0].sequences[0].tokens != alone[0].sequences[1].tokens  # sampled, not greedy


def test_without_padding_only_equal_lengths_share_a_pass(model_dirs):
    """A model whose padded merge is not exact (forced here) merges only rows of equal length; the results are
    the same."""
    path = model_dirs("mistral")
    engine, weights = _engine_with_runs(path)
    jobs = _jobs(path, weights)
    jobs.append((jobs[0][0], SamplingParams(max_tokens=5, top_k=30, seed=3, stop=()), weights[1]))  # prompt 0's length
    alone = [engine.sample(p, params, **w) for p, params, w in jobs]
    sampler = engine.samplers[engine.load_model(path).name]
    sampler.cache.pads = False
    passes = _count_decode_passes(engine, path)
    pending = [engine.submit_sample(p, params, **w) for p, params, w in jobs]
    engine.sample_step()
    assert sorted(b.rows for b in sampler.cache.batches) == [1, 1, 3]  # lengths 9 (2 + 1 rows), 4, 13
    while engine.sample_step():
        pass
    for b, a in zip(pending, alone):
        _assert_same(b, a)
    assert max(passes) == 3


@pytest.mark.parametrize("kind", ["mistral", "qwen3_5_text"])
def test_a_failing_request_in_a_padded_batch_fails_alone(model_dirs, monkeypatch, kind):
    """A decode pass failing for one request's adapter: that request gets the error; the others (of other
    lengths, in the same padded batch, then rebuilt alone) equal each sampled alone."""
    path = model_dirs(kind)
    engine, weights = _engine_with_runs(path)
    jobs = _jobs(path, weights)
    alone = [engine.sample(p, params, **w) for p, params, w in jobs]
    bad = engine.get_run(weights[1]["run_id"]).sampler_versions[weights[1]["version"]]
    real, calls = hf_sampler.step_hidden, []

    def failing(base, tokens, groups, batch):
        calls.append(tokens.shape)
        if tokens.shape[1] == 1 and len(calls) > 4 and any(entry[-1] is bad for entry in groups.bounds):
            raise RuntimeError("request 1's decode failed")
        return real(base, tokens, groups, batch)

    monkeypatch.setattr(hf_sampler, "step_hidden", failing)
    pending = [engine.submit_sample(p, params, **w) for p, params, w in jobs]
    while engine.sample_step():
        pass
    assert isinstance(pending[1].error, RuntimeError)
    for i in (0, 2):
        _assert_same(pending[i], alone[i])
