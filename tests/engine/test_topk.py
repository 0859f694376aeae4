"""Top-k and target log-probs on sampling (engine/prompt_scores.py and the sampler's top_logprobs), on the fast
path and the general path, against a full log_softmax computed in float64 by transformers."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.models import make_tiny_general_model
from whitney.engine import Engine
from whitney.engine.families.general import GeneralModel
from whitney.errors import InvalidInput
from whitney.protocol.sampling import SamplingParams

PROMPT = [1, 873, 2201, 5120, 40, 777, 15, 9000, 31]
ATOL = 2e-5  # float32 engine against the float64 reference


def reference(path: str, tokens: list[int]) -> torch.Tensor:
    """log_softmax of the HF model's logits in float64, [len(tokens), V]: row t scores tokens[t + 1]."""
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float64)
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([tokens])).logits[0], dim=-1)


def check_topk(rows, lp: torch.Tensor, k: int) -> None:
    """Each row holds k (token, log-prob) in descending order, each the reference's value for that token, and
    no left-out token is more likely (beyond rounding) than the least likely one kept: the top k of lp [N, V]."""
    assert len(rows) == lp.shape[0]
    for row, ref in zip(rows, lp):
        assert len(row) == k
        ids, values = [t for t, _ in row], torch.tensor([v for _, v in row], dtype=torch.float64)
        assert len(set(ids)) == k
        torch.testing.assert_close(values, ref[ids], atol=ATOL, rtol=0)
        assert bool((values[:-1] >= values[1:]).all())
        rest = ref.clone()
        rest[ids] = -torch.inf
        assert rest.max() <= values[-1] + ATOL
        exact = torch.topk(ref, k)
        if float(exact.values[-1] - (ref.topk(k + 1).values[-1])) > 1e-4 and float(
                (exact.values[:-1] - exact.values[1:]).min()) > 1e-4:  # no near ties: the same ids, in order
            assert ids == exact.indices.tolist()


def targets_for(lp_rows: int, vocab: int) -> tuple[tuple[int, ...], ...]:
    """[P-1, 3] ids: the first row asks nothing, some cells -1, the rest spread over the vocabulary."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, vocab, (lp_rows, 3), generator=g)
    ids[0] = -1
    ids[2, 1] = -1
    ids[4, 0] = -1
    return tuple(tuple(r) for r in ids.tolist())


def check_all(engine: Engine, path: str, **weights) -> None:
    """Every kind of prompt and sample log-prob in one request (two samples), then the last-n variant."""
    vocab = engine.load_model(path).config.vocab_size
    targets = targets_for(len(PROMPT) - 1, vocab)
    params = SamplingParams(max_tokens=5, temperature=1.0, seed=4, stop=(), num_samples=2, prompt_logprobs=True,
                            topk_prompt_logprobs=6, top_logprobs=4, target_prompt_logprobs=targets)
    result = engine.sample(PROMPT, params, **weights)
    lp = reference(path, PROMPT)
    assert result.prompt_logprobs[0] is None and result.topk_prompt_logprobs[0] is None
    torch.testing.assert_close(torch.tensor(result.prompt_logprobs[1:], dtype=torch.float64),
                               lp[:-1].gather(1, torch.tensor(PROMPT[1:])[:, None])[:, 0], atol=ATOL, rtol=0)
    check_topk(result.topk_prompt_logprobs[1:], lp[:-1], 6)
    assert len(result.target_prompt_logprobs) == len(PROMPT) - 1
    for ids, got, ref in zip(targets, result.target_prompt_logprobs, lp[:-1]):
        for t, v in zip(ids, got):
            assert (v is None) if t < 0 else abs(v - float(ref[t])) < ATOL
    assert result.target_prompt_logprobs[0] == [None, None, None]
    for seq in result.sequences:
        full = reference(path, PROMPT + seq.tokens)[len(PROMPT) - 1:-1]  # [5, V]: what each token was chosen from
        check_topk(seq.top_logprobs, full, 4)
        torch.testing.assert_close(torch.tensor(seq.logprobs, dtype=torch.float64),
                                   full.gather(1, torch.tensor(seq.tokens)[:, None])[:, 0], atol=ATOL, rtol=0)
    assert result.sequences[0].tokens != result.sequences[1].tokens

    last = engine.sample(PROMPT, SamplingParams(max_tokens=1, stop=(), prompt_logprobs=True, topk_prompt_logprobs=2,
                                                prompt_logprobs_last_n=3), **weights)
    assert last.prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    assert last.topk_prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    assert last.prompt_logprobs[-3:] == pytest.approx(result.prompt_logprobs[-3:], abs=1e-6)
    check_topk(last.topk_prompt_logprobs[-3:], lp[-4:-1], 2)
    assert last.target_prompt_logprobs is None and last.sequences[0].top_logprobs is None

    alone = engine.sample(PROMPT, SamplingParams(max_tokens=1, stop=(), target_prompt_logprobs=targets), **weights)
    assert alone.prompt_logprobs is None and alone.topk_prompt_logprobs is None
    for a, b in zip(alone.target_prompt_logprobs, result.target_prompt_logprobs, strict=True):  # the same, alone
        assert [x is None for x in a] == [x is None for x in b] and [x for x in a if x is not None] == pytest.approx(
            [x for x in b if x is not None], abs=1e-6)


def test_fast_path_against_float64_reference(tiny_llama):
    check_all(Engine(device="cpu", compute_dtype="float32"), tiny_llama, base_model=tiny_llama)


def test_general_path_against_float64_reference(tmp_path):
    path = str(make_tiny_general_model(tmp_path / "mistral", "mistral"))
    engine = Engine(device="cpu", compute_dtype="float32")
    check_all(engine, path, base_model=path)
    assert isinstance(engine.load_model(path), GeneralModel)  # the general path's sampler served it


@pytest.mark.parametrize("change, field", [
    (dict(target_prompt_logprobs=((5,),) * 7), "target_prompt_logprobs"),  # P-2 rows
    (dict(target_prompt_logprobs=((5,),) * 7 + ((5, 6),)), "target_prompt_logprobs"),  # ragged
    (dict(target_prompt_logprobs=((),) * 8), "target_prompt_logprobs"),  # width 0
    (dict(target_prompt_logprobs=((5,) * 101,) * 8), "target_prompt_logprobs"),  # wider than 100
    (dict(target_prompt_logprobs=((-1,),) * 8), "target_prompt_logprobs"),  # nothing asked
    (dict(target_prompt_logprobs=((49152,),) * 8), "target_prompt_logprobs"),  # outside the vocabulary
    (dict(target_prompt_logprobs=((-2,),) * 8), "target_prompt_logprobs"),
    (dict(target_prompt_logprobs=((True,),) * 8), "target_prompt_logprobs"),
    (dict(prompt_logprobs_last_n=2), "prompt_logprobs_last_n"),  # without prompt log-probs
    (dict(prompt_logprobs=True, prompt_logprobs_last_n=0), "prompt_logprobs_last_n"),
    (dict(prompt_logprobs=True, prompt_logprobs_last_n=9), "prompt_logprobs_last_n"),  # more than P-1
    (dict(top_logprobs=101), "top_logprobs"),
    (dict(topk_prompt_logprobs=-1), "topk_prompt_logprobs"),
])
def test_bad_requests_name_the_field(tiny_llama, change, field):
    engine = Engine(device="cpu", compute_dtype="float32")
    with pytest.raises(InvalidInput) as e:
        engine.submit_sample(PROMPT, SamplingParams(max_tokens=2, **change), base_model=tiny_llama)
    assert e.value.field == field
