"""The bfloat16 compute mode: base weights and activations in bfloat16, everything the user owns in float32.

float32 stays the default and the exact path (the other engine tests); here bfloat16 is checked against
float32 on the same weights: close log-probs and gradients, float32 adapters and optimizer state,
training that works, and sampling.
"""

from __future__ import annotations

import pytest
import torch

from whitney.engine import Datum, Engine, LoraConfig
from whitney.errors import InvalidInput
from whitney.protocol.sampling import SamplingParams


def _data(g: torch.Generator, rows: int = 3, n: int = 12) -> list[Datum]:
    out = []
    for _ in range(rows):
        toks = torch.randint(100, 1000, (n + 1,), generator=g).tolist()
        out.append(Datum(toks[:-1], {"target_tokens": toks[1:]}))
    return out


def _trained_pair(model: str) -> tuple[Engine, Engine]:
    """A float32 and a bfloat16 engine whose run "r" has the same, non-zero adapter."""
    engines = (Engine(compute_dtype="float32"), Engine(compute_dtype="bfloat16"))
    g = torch.Generator().manual_seed(0)
    for e in engines:
        e.create_run("r", model, LoraConfig(rank=4, seed=1))
    with torch.no_grad():
        for name, t in engines[0].runs["r"].adapter.named_parameters():
            t.normal_(0, 0.05, generator=g)
        weights = dict(engines[0].runs["r"].adapter.named_parameters())
        for name, t in engines[1].runs["r"].adapter.named_parameters():
            t.copy_(weights[name])
    return engines


def test_base_in_bfloat16_user_state_in_float32(tiny_model):
    e = Engine(compute_dtype="bfloat16")
    run = e.create_run("r", tiny_model, LoraConfig(rank=4))
    base = run.base
    assert e.compute_dtype_name == "bfloat16" and base.compute_dtype == torch.bfloat16
    assert base.embed.dtype == base.lm_head.dtype == torch.bfloat16
    assert all(w.dtype == torch.bfloat16 for lw in base.layers for w in lw.linear.values())
    assert base.inv_freq.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in run.adapter.parameters())
    e.forward_backward("r", _data(torch.Generator().manual_seed(1)))
    assert all(g.dtype == torch.float32 for g in run.grads.values())
    e.optim_step("r", {"learning_rate": 1e-2})
    assert all(m.dtype == torch.float32 for m in run.optimizer.exp_avg.values())
    assert all(v.dtype == torch.float32 for v in run.optimizer.exp_avg_sq.values())


def test_logprobs_and_gradients_close_to_float32(tiny_model):
    f32, bf16 = _trained_pair(tiny_model)
    data = _data(torch.Generator().manual_seed(2))
    r32 = f32.forward_backward("r", data)
    r16 = bf16.forward_backward("r", data)
    lp32 = torch.tensor([x for o in r32.outputs for x in o.logprobs])
    lp16 = torch.tensor([x for o in r16.outputs for x in o.logprobs])
    assert lp16.dtype == torch.float32
    # bfloat16 keeps 8 significant bits: log-probs agree to a few hundredths, not exactly.
    assert float((lp32 - lp16).abs().max()) < 0.1
    assert r16.loss == pytest.approx(r32.loss, rel=2e-2)
    assert not torch.equal(lp32, lp16)  # really a different compute path
    g32 = torch.cat([g.flatten() for g in f32.runs["r"].grads.values()])
    g16 = torch.cat([bf16.runs["r"].grads[k].flatten() for k in f32.runs["r"].grads])
    cos = float(torch.nn.functional.cosine_similarity(g32.double(), g16.double(), dim=0))
    assert cos > 0.99, cos
    assert float(g16.norm() / g32.norm()) == pytest.approx(1.0, abs=0.05)


def test_training_in_bfloat16_lowers_the_loss(tiny_llama):
    e = Engine(compute_dtype=torch.bfloat16)
    e.create_run("r", tiny_llama, LoraConfig(rank=8))
    data = _data(torch.Generator().manual_seed(3), rows=2, n=8)
    losses = []
    for _ in range(8):
        losses.append(e.forward_backward("r", data).loss)
        e.optim_step("r", {"learning_rate": 2e-2})
    assert losses[-1] < 0.7 * losses[0], losses


def test_sampling_and_compute_logprobs_in_bfloat16(tiny_model):
    f32, bf16 = _trained_pair(tiny_model)
    versions = [e.save_weights_for_sampler("r") for e in (f32, bf16)]
    prompt = [5, 6, 7, 8]
    greedy = [e.sample(prompt, SamplingParams(max_tokens=6, temperature=0.0), run_id="r", version=v)
              for e, v in zip((f32, bf16), versions)]
    seq = prompt + greedy[1].sequences[0].tokens
    assert len(greedy[1].sequences[0].tokens) == 6
    lp = [e.compute_logprobs([seq], run_id="r", version=v)[0] for e, v in zip((f32, bf16), versions)]
    assert lp[1][0] is None and len(lp[1]) == len(seq)
    assert max(abs(a - b) for a, b in zip(lp[0][1:], lp[1][1:])) < 0.1
    # The sampler's own log-probs of its tokens agree with a full forward in the same mode.
    sampled = greedy[1].sequences[0].logprobs
    assert max(abs(a - b) for a, b in zip(sampled, lp[1][len(prompt):])) < 0.05


def test_unknown_compute_dtype_refused():
    with pytest.raises(InvalidInput, match="compute dtype"):
        Engine(compute_dtype="float16")
