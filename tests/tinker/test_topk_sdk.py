"""Top-k and target log-probs through the Tinker SDK and the native API on one real server: topk_prompt_logprobs,
topk_sample_logprobs, target_prompt_logprobs (dense and sparse CSR) and prompt_logprobs_last_n, with the SDK's
empty-slot convention, against a full log_softmax computed in float64 by transformers."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.types.topk_logprobs import MASK_LOGPROB
from transformers import AutoModelForCausalLM

import whitney

PROMPT = [1, 17, 250, 4000, 12, 99, 3030, 777]
ATOL = 2e-5  # float32 on the wire against the float64 reference


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """tokens -> log_softmax of the HF model's logits in float64, [len(tokens), V]."""
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float64)

    def logprobs(tokens: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([tokens])).logits[0], dim=-1)
    return logprobs


@pytest.fixture(scope="module")
def sampler(service_client, tiny_llama):
    return service_client.create_sampling_client(base_model=tiny_llama).result()


@pytest.fixture(scope="module")
def native(tinker_env):
    client = whitney.Client(tinker_env.url)
    yield client
    client.close()


def check_topk(rows, lp: torch.Tensor, k: int) -> None:
    """Each row is the top k of the reference row: k distinct ids in descending order, each with the reference's
    log-prob, and no left-out token more likely than the last kept."""
    assert len(rows) == lp.shape[0]
    for row, ref in zip(rows, lp):
        assert len(row) == k and len({t for t, _ in row}) == k
        ids, values = [t for t, _ in row], torch.tensor([v for _, v in row], dtype=torch.float64)
        torch.testing.assert_close(values, ref[ids], atol=ATOL, rtol=0)
        assert bool((values[:-1] >= values[1:]).all())
        rest = ref.clone()
        rest[ids] = -torch.inf
        assert rest.max() <= values[-1] + ATOL


def target_ids() -> torch.Tensor:
    """[P-1, 4] int64 ids; -1 in the first two rows (nothing asked) and a few other cells."""
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 49152, (len(PROMPT) - 1, 4), generator=g)
    ids[:2] = -1
    ids[3, 2] = -1
    return ids


def expected_targets(ids: torch.Tensor, lp: torch.Tensor) -> torch.Tensor:
    """[P-1, K] float64: lp at prompt position i + 1 of each id, 0.0 where the id is -1 (the SDK's layout)."""
    return torch.where(ids >= 0, lp[:-1].gather(1, ids.clamp(min=0)), torch.zeros((), dtype=torch.float64))


def test_every_topk_field_against_the_reference(sampler, reference):
    ids = target_ids()
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=4, seed=3),
                         include_prompt_logprobs=True, topk_prompt_logprobs=5, topk_sample_logprobs=3,
                         target_prompt_logprobs=types.TensorData.from_torch(ids)).result()
    lp = reference(PROMPT)
    assert got.prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(got.prompt_logprobs[1:], dtype=torch.float64),
                               lp[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0], atol=ATOL, rtol=0)
    # The empty slot: position 0 is the sentinel row (token 0, -99999), which the SDK reads as None.
    assert got.topk_prompt_logprobs_np.token_ids.shape == (len(PROMPT), 5)
    assert (got.topk_prompt_logprobs_np.token_ids[0] == 0).all()
    assert (got.topk_prompt_logprobs_np.logprobs[0] == MASK_LOGPROB).all()
    assert got.topk_prompt_logprobs[0] is None
    check_topk(got.topk_prompt_logprobs[1:], lp[:-1], 5)
    target = got.target_prompt_logprobs
    assert target.dtype == "float32" and target.shape == [len(PROMPT) - 1, 4] and target.sparse_crow_indices is None
    torch.testing.assert_close(target.to_torch().double(), expected_targets(ids, lp), atol=ATOL, rtol=0)
    assert len(got.sequences) == 2
    for seq in got.sequences:
        full = reference(PROMPT + list(seq.tokens))[len(PROMPT) - 1:-1]  # what each sampled token was chosen from
        assert seq.topk_logprobs_np.token_ids.shape == (len(seq.tokens), 3)
        check_topk(seq.topk_logprobs, full, 3)
        torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float64),
                                   full.gather(1, torch.tensor(seq.tokens)[:, None])[:, 0], atol=ATOL, rtol=0)


def test_sparse_target_gets_a_sparse_answer(sampler, reference):
    ids = torch.full((len(PROMPT) - 1, 6), -1, dtype=torch.int64)
    ids[2, 1], ids[5, 4], ids[6, 0] = 40, 9000, 3
    sparse = types.TensorData.from_torch_sparse(ids, pad_value=-1)
    assert sparse.sparse_crow_indices is not None
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                         target_prompt_logprobs=sparse).result()
    assert got.prompt_logprobs is None and got.topk_prompt_logprobs is None
    assert got.sequences[0].topk_logprobs is None
    target = got.target_prompt_logprobs
    assert target.sparse_crow_indices == sparse.sparse_crow_indices
    assert target.sparse_col_indices == sparse.sparse_col_indices
    torch.testing.assert_close(target.to_torch().double(), expected_targets(ids, reference(PROMPT)), atol=ATOL,
                               rtol=0)


def test_last_n_scores_only_the_suffix(sampler, reference):
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1),
                         include_prompt_logprobs=True, topk_prompt_logprobs=2, prompt_logprobs_last_n=3).result()
    lp = reference(PROMPT)
    assert got.prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    assert got.topk_prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    assert np.isnan(got.prompt_logprobs_np[:-3]).all()
    torch.testing.assert_close(torch.tensor(got.prompt_logprobs[-3:], dtype=torch.float64),
                               lp[-4:-1].gather(1, torch.tensor(PROMPT[-3:])[:, None])[:, 0], atol=ATOL, rtol=0)
    check_topk(got.topk_prompt_logprobs[-3:], lp[-4:-1], 2)


def test_native_api_serves_the_same(native, sampler, tiny_llama, reference):
    ids = target_ids()
    params = dict(max_tokens=3, seed=8, num_samples=2, prompt_logprobs=True, topk_prompt_logprobs=4)
    out = native.sample(PROMPT, base_model=tiny_llama, topk_sample_logprobs=3, prompt_logprobs_last_n=5,
                        target_prompt_logprobs=ids.tolist(), **params).result()
    got = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, types.SamplingParams(max_tokens=3, seed=8),
                         include_prompt_logprobs=True, topk_prompt_logprobs=4, topk_sample_logprobs=3,
                         prompt_logprobs_last_n=5, target_prompt_logprobs=types.TensorData.from_torch(ids)).result()
    lp = reference(PROMPT)
    assert out["prompt_logprobs"][:-5] == [None] * 3 and out["topk_prompt_logprobs"][:-5] == [None] * 3
    check_topk(out["topk_prompt_logprobs"][-5:], lp[-6:-1], 4)
    for row, ids_row, ref in zip(out["target_prompt_logprobs"], ids.tolist(), expected_targets(ids, lp)):
        assert [v is None for v in row] == [t < 0 for t in ids_row]
        assert [0.0 if v is None else v for v in row] == pytest.approx(ref.tolist(), abs=ATOL)
    for wire, seq in zip(out["sequences"], got.sequences, strict=True):
        assert wire["tokens"] == list(seq.tokens)
        assert [[t for t, _ in r] for r in wire["top_logprobs"]] == [[t for t, _ in r] for r in seq.topk_logprobs]
    assert [t for t, _ in got.topk_prompt_logprobs[-1]] == [t for t, _ in out["topk_prompt_logprobs"][-1]]


@pytest.mark.parametrize("kwargs, field", [
    (dict(target_prompt_logprobs=[[5]] * 3), "target_prompt_logprobs"),  # not P-1 rows
    (dict(target_prompt_logprobs=[[-1, -1]] * 7), "target_prompt_logprobs"),  # nothing asked
    (dict(target_prompt_logprobs=[[49152]] * 7), "target_prompt_logprobs"),
    (dict(topk_sample_logprobs=101), "topk_sample_logprobs"),
    (dict(prompt_logprobs=True, prompt_logprobs_last_n=8), "prompt_logprobs_last_n"),
    (dict(prompt_logprobs_last_n=2), "prompt_logprobs_last_n"),
])
def test_native_bad_requests_are_4xx_naming_the_field(native, tiny_llama, kwargs, field):
    with pytest.raises(whitney.WhitneyAPIError) as e:
        native.sample(PROMPT, base_model=tiny_llama, **kwargs)
    assert e.value.status in (400, 422) and field in f"{e.value.field} {e.value}"


@pytest.mark.parametrize("kwargs, field", [
    (dict(target_prompt_logprobs=types.TensorData.from_torch(torch.full((3, 2), 5))), "target_prompt_logprobs"),
    (dict(target_prompt_logprobs=types.TensorData.from_torch(torch.full((7, 2), -1))), "target_prompt_logprobs"),
    (dict(target_prompt_logprobs=types.TensorData(data=[5], dtype="int64", shape=[10**9, 100],
                                                  sparse_crow_indices=[0, 1], sparse_col_indices=[0])),
     "target_prompt_logprobs"),  # refused by its shape before anything of that size is made
    (dict(target_prompt_logprobs=types.TensorData(data=[5, 6], dtype="int64", shape=[7, 2],
                                                  sparse_crow_indices=[0, 1, 2, 2, 2, 2, 2, 2],
                                                  sparse_col_indices=[0, 2])), "target_prompt_logprobs"),
    (dict(topk_sample_logprobs=500), "topk_sample_logprobs"),
    (dict(include_prompt_logprobs=True, prompt_logprobs_last_n=8), "prompt_logprobs_last_n"),
])
def test_sdk_bad_requests_are_refused_naming_the_field(sampler, kwargs, field):
    with pytest.raises(tinker.BadRequestError, match=field):
        sampler.sample(types.ModelInput.from_ints(PROMPT), 1, types.SamplingParams(max_tokens=1), **kwargs).result()
