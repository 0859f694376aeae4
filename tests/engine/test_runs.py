"""Runs on a shared base: creation, mixed batches equal solo runs, isolation, accumulation, sampler versions."""

from __future__ import annotations

import argparse
import math

import pytest
import torch

from tests.models import VOCAB
from whitney.backends.in_process import InProcessBackend
from whitney.cli import add_engine_flags, engine_config
from whitney.engine import Datum, Engine, ForwardRequest, ForwardResult, LoraConfig
from whitney.engine.families.model import load_base_model
from whitney.engine.families.modules import module_path
from whitney.errors import Conflict, InvalidInput, NotFound

REL = 1e-5
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
LR = {"learning_rate": 1e-2}


@pytest.fixture(scope="module")
def bases(tiny_llama, tiny_qwen3):
    """Each tiny base loaded once for this module; engines below share them (they are never written)."""
    return {p: load_base_model(p) for p in (tiny_llama, tiny_qwen3)}


def new_engine(bases, **kwargs) -> Engine:
    engine = Engine(**kwargs)
    engine.models.update(bases)
    return engine


# ---- helpers -------------------------------------------------------------------------------


def seq(g: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=g).tolist()


def ce(g: torch.Generator, n: int, weights: bool = False, k: int = 0) -> Datum:
    """A next-token datum of n inputs; k > 0 gives soft targets [n, k] with weights."""
    s = seq(g, n + 1)
    inputs: dict = {"target_tokens": s[1:]}
    if k:
        inputs["target_tokens"] = [[t, *seq(g, k - 1)] for t in s[1:]]
        inputs["weights"] = torch.rand(n, k, generator=g).tolist()
    elif weights:
        inputs["weights"] = (torch.rand(n, generator=g) * 2 - 0.5).tolist()
    return Datum(s[:-1], inputs)


def rl_data(engine: Engine, run_id: str, g: torch.Generator, lengths: list[int]) -> list[Datum]:
    """ppo datums whose old_logprobs are the run's own log-probs plus noise (so some ratios clip)."""
    data = [ce(g, n) for n in lengths]
    lps = engine.forward(run_id, data).outputs
    out = []
    for d, o in zip(data, lps):
        n = len(d.token_ids)
        noise = (torch.rand(n, generator=g) - 0.5) * 0.6
        out.append(Datum(d.token_ids, {"target_tokens": d.loss_inputs["target_tokens"],
                                       "old_logprobs": (torch.tensor(o.logprobs) + noise).tolist(),
                                       "advantages": torch.randn(n, generator=g).tolist()}))
    return out


def train(engine: Engine, run_id: str, g: torch.Generator, steps: int = 1) -> None:
    for _ in range(steps):
        engine.forward_backward(run_id, [ce(g, 6)])
        engine.optim_step(run_id, LR)
    assert any(float(b.detach().abs().max()) > 0 for b in engine.runs[run_id].adapter.B.values())


def grads_of(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.runs[run_id].grads.items()}


def zero_grads(engine: Engine, run_id: str) -> None:
    for g in engine.runs[run_id].grads.values():
        g.zero_()


def all_zero(grads: dict[str, torch.Tensor]) -> bool:
    return all(float(g.abs().max()) == 0 for g in grads.values())


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def assert_grads_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    flat_got = torch.cat([got[k].flatten() for k in want])
    flat_want = torch.cat([want[k].flatten() for k in want])
    assert float(flat_want.norm()) > 0, "reference gradient is zero: the comparison would be vacuous"
    assert rel_diff(flat_got, flat_want) < REL
    scale = float(flat_want.abs().max())
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=REL, atol=REL * scale, msg=k)


def assert_results_close(got: ForwardResult, want: ForwardResult) -> None:
    assert isinstance(got, ForwardResult), got
    assert abs(got.loss - want.loss) <= REL * max(abs(want.loss), 1e-6)
    assert len(got.outputs) == len(want.outputs)
    for o, w in zip(got.outputs, want.outputs):
        assert len(o.logprobs) == len(w.logprobs)
        torch.testing.assert_close(torch.tensor(o.logprobs), torch.tensor(w.logprobs), rtol=REL, atol=1e-6)
        torch.testing.assert_close(torch.tensor(o.elementwise_loss), torch.tensor(w.elementwise_loss),
                                   rtol=REL, atol=1e-6)


def snapshot(engine: Engine, run_id: str) -> dict[str, torch.Tensor]:
    run = engine.runs[run_id]
    out = {f"w:{k}": v.detach().clone() for k, v in run.adapter.named_parameters()}
    out.update({f"g:{k}": v.clone() for k, v in run.grads.items()})
    out.update({f"m:{k}": v.clone() for k, v in run.optimizer.exp_avg.items()})
    out.update({f"v:{k}": v.clone() for k, v in run.optimizer.exp_avg_sq.items()})
    out["step"] = torch.tensor(run.optimizer.step)
    return out


def assert_same_snapshot(engine: Engine, run_id: str, before: dict[str, torch.Tensor]) -> None:
    after = snapshot(engine, run_id)
    assert after.keys() == before.keys()
    for k in before:
        assert torch.equal(after[k], before[k]), k


# ---- creating runs -------------------------------------------------------------------------


def test_new_run_equals_base_model(bases, tiny_model):
    engine = new_engine(bases)
    engine.create_run("r", tiny_model, LoraConfig(rank=4, seed=9))
    assert all(float(b.detach().abs().max()) == 0 for b in engine.runs["r"].adapter.B.values())
    g = torch.Generator().manual_seed(0)
    data = [ce(g, 7), ce(g, 3, weights=True)]
    run_out = engine.forward("r", data)
    base_out = engine.forward(None, data, base_model=tiny_model)
    assert run_out.loss == base_out.loss
    for o, b in zip(run_out.outputs, base_out.outputs):
        assert o.logprobs == b.logprobs and o.elementwise_loss == b.elementwise_loss
    # Control: once trained, the run no longer equals the base.
    train(engine, "r", g)
    assert engine.forward("r", data).outputs[0].logprobs != base_out.outputs[0].logprobs


def test_seed_determines_a(bases, tiny_llama):
    engine = new_engine(bases)
    s1 = engine.create_run("s1", tiny_llama, LoraConfig(rank=4, seed=3))
    s2 = engine.create_run("s2", tiny_llama, LoraConfig(rank=4, seed=3))
    s3 = engine.create_run("s3", tiny_llama, LoraConfig(rank=4, seed=4))
    other = new_engine(bases).create_run("s1", tiny_llama, LoraConfig(rank=4, seed=3))
    for name in s1.adapter.A:
        assert torch.equal(s1.adapter.A[name], s2.adapter.A[name])
        assert torch.equal(s1.adapter.A[name], other.adapter.A[name])
        assert not torch.equal(s1.adapter.A[name], s3.adapter.A[name])
        assert s1.adapter.A[name].data_ptr() != s2.adapter.A[name].data_ptr()  # equal, never shared
        fan_in, fan_out = s1.base.linear_shapes[name]
        assert s1.adapter.A[name].shape == (4, fan_in) and s1.adapter.B[name].shape == (fan_out, 4)
        assert float(s1.adapter.A[name].abs().max()) <= 1 / math.sqrt(fan_in)
        assert float(s1.adapter.A[name].abs().max()) > 0
        assert not s1.adapter.B[name].any()


@pytest.mark.parametrize("field,kwargs", [
    ("rank", {"rank": 0}),
    ("rank", {"rank": -3}),
    ("rank", {"rank": 9}),  # engine max is 8 below
    ("rank", {"rank": 2.0}),
    ("rank", {"rank": "4"}),
    ("rank", {"rank": True}),
    ("alpha", {"alpha": 0}),
    ("alpha", {"alpha": -1.0}),
    ("alpha", {"alpha": math.nan}),
    ("alpha", {"alpha": math.inf}),
    ("alpha", {"alpha": "16"}),
    ("alpha", {"alpha": True}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 1.5}),
    ("seed", {"seed": True}),
])
def test_lora_config_validation(bases, tiny_llama, field, kwargs):
    engine = new_engine(bases, max_lora_rank=8)
    with pytest.raises(InvalidInput) as e:
        engine.create_run("r", tiny_llama, LoraConfig(**{"rank": 4, **kwargs}))
    assert e.value.field == field, e.value.to_dict()
    assert "r" not in engine.runs
    engine.create_run("r", tiny_llama, LoraConfig(rank=8))  # the id is still free; max rank itself is fine


def test_duplicate_run_id_conflicts(bases, tiny_llama):
    engine = new_engine(bases)
    engine.create_run("r", tiny_llama, LoraConfig(rank=2))
    with pytest.raises(Conflict) as e:
        engine.create_run("r", tiny_llama, LoraConfig(rank=2))
    assert e.value.field == "run_id"


def _short_names(keys) -> set[str]:
    return {"lm_head" if k == "lm_head" else k.rsplit(".", 1)[1] for k in keys}


@pytest.mark.parametrize("flags,expected", [
    ({}, ATTN + MLP + ["lm_head"]),
    ({"train_mlp": False, "train_unembed": False}, ATTN),
    ({"train_attn": False, "train_unembed": False}, MLP),
    ({"train_attn": False, "train_mlp": False}, ["lm_head"]),
    ({"train_unembed": False}, ATTN + MLP),
    ({"target_modules": ("q_proj", "v_proj")}, ["q_proj", "v_proj"]),
    ({"target_modules": ("lm_head", "down_proj"), "train_unembed": False}, ["down_proj", "lm_head"]),
])
def test_module_selection(bases, tiny_model, flags, expected):
    engine = new_engine(bases)
    run = engine.create_run("r", tiny_model, LoraConfig(rank=2, **flags))
    keys = list(run.adapter.A)
    assert _short_names(keys) == set(expected)
    want = {module_path(i, p) for i in range(run.base.config.num_layers) for p in expected if p != "lm_head"}
    want |= {"lm_head"} if "lm_head" in expected else set()
    assert set(keys) == want and len(keys) == len(want)
    assert set(run.adapter.B) == want
    engine.forward_backward("r", [Datum([1, 2, 3], {"target_tokens": [2, 3, 4]})])
    assert set(run.grads) == {f"{k}.lora_{ab}" for k in want for ab in "AB"}


@pytest.mark.parametrize("flags,field", [
    ({"target_modules": ("q_proj", "foo_proj")}, "target_modules"),
    ({"target_modules": ()}, "target_modules"),
    ({"train_attn": False, "train_mlp": False, "train_unembed": False}, "train_attn"),
])
def test_module_selection_refused(bases, tiny_llama, flags, field):
    with pytest.raises(InvalidInput) as e:
        new_engine(bases).create_run("r", tiny_llama, LoraConfig(rank=2, **flags))
    assert e.value.field == field
    if "foo_proj" in str(flags):
        assert "foo_proj" in e.value.message and "q_proj" in e.value.message


# ---- mixed batches equal solo runs ---------------------------------------------------------


@pytest.fixture
def three_runs(bases, tiny_qwen3):
    """Three trained runs (B != 0) of different ranks, seeds and modules, with their requests."""
    engine = new_engine(bases)
    engine.create_run("a", tiny_qwen3, LoraConfig(rank=4, alpha=8.0, seed=1))
    engine.create_run("b", tiny_qwen3, LoraConfig(rank=8, alpha=4.0, seed=2, train_mlp=False))
    engine.create_run("c", tiny_qwen3, LoraConfig(rank=2, alpha=2.0, seed=3, train_attn=False, train_unembed=False))
    g = torch.Generator().manual_seed(42)
    train(engine, "a", g, steps=2)
    train(engine, "b", g)
    train(engine, "c", g)
    reqs = {
        "a": ForwardRequest("a", [ce(g, 9, weights=True), ce(g, 4)]),
        "b": ForwardRequest("b", rl_data(engine, "b", g, [3, 12]), "ppo", {"clip_low": 0.1, "clip_high": 0.1}),
        "c": ForwardRequest("c", [ce(g, 7, k=3), ce(g, 2, k=3)]),
    }
    for r in engine.runs:
        assert all_zero(engine.runs[r].grads)
    return engine, reqs, g


def test_mixed_backward_batch_equals_solo(three_runs):
    engine, reqs, _ = three_runs
    batch = engine.run_batch([reqs["a"], reqs["b"], reqs["c"]], backward=True)
    batch_grads = {r: grads_of(engine, r) for r in "abc"}
    for r in "abc":
        zero_grads(engine, r)
    assert batch[1].metrics["clipped_fraction:mean"] > 0  # the ppo clip is exercised
    for i, r in enumerate("abc"):
        (solo,) = engine.run_batch([reqs[r]], backward=True)
        assert_results_close(batch[i], solo)
        assert_grads_close(batch_grads[r], grads_of(engine, r))
        for other in "abc":
            if other != r:
                assert all_zero(engine.runs[other].grads)
        zero_grads(engine, r)
    # Soft-target rows return K-averaged log-probs, one per position.
    assert [len(o.logprobs) for o in batch[2].outputs] == [7, 2]


def test_a_training_call_beyond_the_pass_budget_runs_in_passes_each_equal_to_one_pass(three_runs, monkeypatch):
    """A call whose kept activations would pass max_pass_mib runs as several forward+backward passes (each
    request whole); its results and each run's gradient equal those of the one pass. A forward keeps no
    activations: one pass whatever the budget."""
    engine, reqs, _ = three_runs
    order = [reqs["a"], reqs["b"], reqs["c"]]
    passes = []
    compute = engine._compute
    monkeypatch.setattr(engine, "_compute", lambda base, items, backward: passes.append(len(items)) or
                        compute(base, items, backward))
    one = engine.run_batch(order, backward=True)
    one_grads = {r: grads_of(engine, r) for r in "abc"}
    assert passes == [3]
    # 2**20 // 20: a budget of 20 padded tokens (a: 2 x 9, b: 2 x 12, c: 2 x 7): a, b and c alone
    monkeypatch.setattr("whitney.engine.training.runs.activation_bytes_per_token", lambda config, dtype: 2**20 // 20)
    engine.max_pass_mib = 1
    for r in "abc":
        zero_grads(engine, r)
    split = engine.run_batch(order, backward=True)
    assert passes == [3, 1, 1, 1]
    for r, got, want in zip("abc", split, one):
        assert_results_close(got, want)
        assert_grads_close(grads_of(engine, r), one_grads[r])
    engine.run_batch(order, backward=False)
    assert passes == [3, 1, 1, 1, 3]


def test_the_pass_budget_is_an_integer_of_mib_or_the_devices_default(bases):
    """`whitney serve --max-pass-mib` -> EngineConfig -> the engine (and back in the backend's config)."""
    assert new_engine(bases).max_pass_mib == 2048  # the CPU's
    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    assert engine_config(parser.parse_args([])).max_pass_mib is None
    config = engine_config(parser.parse_args(["--max-pass-mib", "64"]))
    assert InProcessBackend.start(config, []).config.max_pass_mib == 64
    for bad in ("0", "-1", "1.5", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-pass-mib", bad])
    for bad in (0, -1, 1.5, True, "64"):
        with pytest.raises(InvalidInput) as e:
            new_engine(bases, max_pass_mib=bad)
        assert e.value.field == "max_pass_mib" and ">= 1" in e.value.message


def test_mixed_forward_batch_with_base_request_equals_solo(three_runs, tiny_llama):
    engine, reqs, g = three_runs
    base_name = engine.runs["a"].base.name
    base_req = ForwardRequest(None, [ce(g, 5), ce(g, 10)], base_model=base_name)
    engine.create_run("l", tiny_llama, LoraConfig(rank=2, seed=5))  # another base model in the same batch
    train(engine, "l", g)
    other_model = ForwardRequest("l", [ce(g, 6)])
    order = [reqs["c"], base_req, reqs["a"], other_model, reqs["b"]]
    batch = engine.run_batch(order, backward=False)
    for got, req in zip(batch, order):
        (solo,) = engine.run_batch([req], backward=False)
        assert_results_close(got, solo)
    # The base request saw no adapter: it equals a fresh (B = 0) run's forward.
    engine.create_run("fresh", base_name, LoraConfig(rank=2))
    fresh = engine.forward("fresh", base_req.data)
    assert_results_close(batch[1], fresh)
    unadapted = engine.forward(None, reqs["a"].data, base_model=base_name)
    assert batch[2].outputs[0].logprobs != unadapted.outputs[0].logprobs
    for r in engine.runs:
        assert all_zero(engine.runs[r].grads)  # forward adds no gradient


def test_base_request_without_model_name_uses_default(bases, tiny_llama, monkeypatch):
    """run_id None and base_model None mean the default model, in a batch too."""
    import whitney.engine.training.runs as runs_mod

    monkeypatch.setattr(runs_mod, "DEFAULT_MODEL", tiny_llama)
    engine = new_engine(bases)
    g = torch.Generator().manual_seed(3)
    data = [ce(g, 4)]
    (got,) = engine.run_batch([ForwardRequest(None, data)], backward=False)
    assert isinstance(got, ForwardResult), got
    assert_results_close(got, engine.forward(None, data, base_model=tiny_llama))


# ---- isolation -----------------------------------------------------------------------------


def test_runs_are_isolated(bases, tiny_llama):
    engine = new_engine(bases)
    # Same config and seed: equal start, separate tensors.
    engine.create_run("A", tiny_llama, LoraConfig(rank=4, seed=1))
    engine.create_run("B", tiny_llama, LoraConfig(rank=4, seed=1))
    g = torch.Generator().manual_seed(5)
    train(engine, "B", g)
    engine.forward_backward("B", [ce(g, 5)])  # B has optimizer state and pending gradients
    before_b = snapshot(engine, "B")
    assert not all_zero(engine.runs["B"].grads) and engine.runs["B"].optimizer.step == 1
    before_a = snapshot(engine, "A")

    engine.forward_backward("A", [ce(g, 8), ce(g, 3)])
    assert_same_snapshot(engine, "B", before_b)
    assert not all_zero(engine.runs["A"].grads)

    engine.optim_step("A", LR)
    assert_same_snapshot(engine, "B", before_b)
    after_a = snapshot(engine, "A")
    assert not torch.equal(after_a["w:lm_head.lora_B"], before_a["w:lm_head.lora_B"])  # A did move
    assert all_zero(engine.runs["A"].grads) and engine.runs["A"].optimizer.step == 1

    # And B's optimizer step leaves A alone.
    engine.optim_step("B", LR)
    assert_same_snapshot(engine, "A", after_a)


# ---- gradient accumulation -----------------------------------------------------------------


def test_gradient_accumulation(bases, tiny_qwen3):
    engine = new_engine(bases)
    engine.create_run("r", tiny_qwen3, LoraConfig(rank=4, seed=2))
    g = torch.Generator().manual_seed(8)
    train(engine, "r", g)
    d1, d2 = [ce(g, 6), ce(g, 3, weights=True)], [ce(g, 10)]

    l1 = engine.forward_backward("r", d1).loss
    l2 = engine.forward_backward("r", d2).loss
    sequential = grads_of(engine, "r")
    zero_grads(engine, "r")
    together = engine.forward_backward("r", d1 + d2)
    joint = grads_of(engine, "r")
    zero_grads(engine, "r")
    engine.run_batch([ForwardRequest("r", d1), ForwardRequest("r", d2)], backward=True)  # same run twice
    batched = grads_of(engine, "r")

    assert abs(together.loss - (l1 + l2)) <= REL * abs(together.loss)
    assert_grads_close(sequential, joint)
    assert_grads_close(batched, joint)
    # A single forward_backward gives less than the sum: accumulation really adds.
    assert rel_diff(sequential["lm_head.lora_B"], grads_of(engine, "r")["lm_head.lora_B"]) < REL
    w_before = {k: v.detach().clone() for k, v in engine.runs["r"].adapter.named_parameters()}
    metrics = engine.optim_step("r", LR)
    assert metrics["grad_norm"] > 0
    assert all_zero(engine.runs["r"].grads)
    assert any(not torch.equal(v, w_before[k]) for k, v in engine.runs["r"].adapter.named_parameters())


# ---- rejected requests ---------------------------------------------------------------------


def test_rejected_request_adds_no_gradient(bases, tiny_llama):
    engine = new_engine(bases)
    engine.create_run("ok", tiny_llama, LoraConfig(rank=4, seed=1))
    engine.create_run("bad", tiny_llama, LoraConfig(rank=4, seed=2))
    g = torch.Generator().manual_seed(9)
    train(engine, "ok", g)
    train(engine, "bad", g)
    good_req = ForwardRequest("ok", [ce(g, 6), ce(g, 4)])
    bad_data = [ce(g, 5), ce(g, 5)]
    bad_data[1].loss_inputs["target_tokens"] = bad_data[1].loss_inputs["target_tokens"][:-1]  # [4] for N = 5
    bad_same_run = ForwardRequest("ok", [ce(g, 3), Datum([1, 2, 3], {"target_tokens": [1, 2, VOCAB]})])
    requests = [good_req, ForwardRequest("bad", bad_data), bad_same_run,
                ForwardRequest("nope", [ce(g, 3)]), ForwardRequest(None, [ce(g, 3)], base_model=tiny_llama)]
    out = engine.run_batch(requests, backward=True)

    assert isinstance(out[0], ForwardResult)
    assert isinstance(out[1], InvalidInput) and out[1].field == "target_tokens" and out[1].datum_index == 1
    assert "[5]" in out[1].message and "[4]" in out[1].message
    assert isinstance(out[2], InvalidInput) and out[2].field == "target_tokens" and out[2].datum_index == 1
    assert isinstance(out[3], NotFound) and out[3].field == "run_id"
    assert isinstance(out[4], InvalidInput) and out[4].field == "run_id"  # forward_backward needs a run
    assert all_zero(engine.runs["bad"].grads)
    batch_grads = grads_of(engine, "ok")
    zero_grads(engine, "ok")
    engine.forward_backward("ok", good_req.data)  # only the valid request's gradient was added
    assert_grads_close(batch_grads, grads_of(engine, "ok"))
    with pytest.raises(InvalidInput):
        engine.forward_backward("bad", bad_data)
    assert all_zero(engine.runs["bad"].grads)


def test_forward_leaves_grads_zero(bases, tiny_llama):
    engine = new_engine(bases)
    engine.create_run("r", tiny_llama, LoraConfig(rank=4, seed=1))
    g = torch.Generator().manual_seed(10)
    train(engine, "r", g)
    before = snapshot(engine, "r")
    out = engine.forward("r", [ce(g, 7), ce(g, 2)])
    assert out.loss > 0
    assert_same_snapshot(engine, "r", before)  # weights, zero grads and optimizer untouched
    assert all_zero(engine.runs["r"].grads)
    # Nor does it disturb gradients already accumulated.
    engine.forward_backward("r", [ce(g, 4)])
    pending = snapshot(engine, "r")
    engine.forward("r", [ce(g, 5)])
    assert_same_snapshot(engine, "r", pending)


# ---- compute_logprobs and sampler versions -------------------------------------------------


def test_compute_logprobs_and_sampler_versions(bases, tiny_llama):
    engine = new_engine(bases)
    engine.create_run("r", tiny_llama, LoraConfig(rank=4, seed=1))
    g = torch.Generator().manual_seed(11)
    train(engine, "r", g)
    assert engine.save_weights_for_sampler("r") == 1
    seqs = [seq(g, 8), seq(g, 1), seq(g, 3)]
    v1 = engine.compute_logprobs(seqs, run_id="r", version=1)
    assert [len(x) for x in v1] == [8, 1, 3]
    assert v1[1] == [None]
    for s, lp in zip(seqs, v1):
        assert lp[0] is None
        if len(s) > 1:
            ref = engine.forward("r", [Datum(s[:-1], {"target_tokens": s[1:]})]).outputs[0].logprobs
            torch.testing.assert_close(torch.tensor(lp[1:]), torch.tensor(ref), rtol=REL, atol=1e-6)

    train(engine, "r", g)
    assert engine.save_weights_for_sampler("r") == 2
    assert engine.compute_logprobs(seqs, run_id="r", version=1) == v1  # pinned: later training never shows
    v2 = engine.compute_logprobs(seqs, run_id="r", version=2)
    assert v2[0] != v1[0]
    train(engine, "r", g)  # version 2 is a copy too
    assert engine.compute_logprobs(seqs, run_id="r", version=2) == v2
    assert engine.save_weights_for_sampler("r") == 3

    base = engine.compute_logprobs(seqs, base_model=tiny_llama)
    ref = engine.forward(None, [Datum(seqs[0][:-1], {"target_tokens": seqs[0][1:]})], base_model=tiny_llama)
    assert base[0][0] is None
    torch.testing.assert_close(torch.tensor(base[0][1:]), torch.tensor(ref.outputs[0].logprobs), rtol=REL, atol=1e-6)
    assert base[0] != v1[0]

    with pytest.raises(NotFound) as e:
        engine.compute_logprobs(seqs, run_id="r", version=7)
    assert e.value.field == "version" and "7" in e.value.message
    with pytest.raises(InvalidInput) as e:
        engine.compute_logprobs(seqs, run_id="r")
    assert e.value.field == "version"
    with pytest.raises(NotFound) as e:
        engine.compute_logprobs(seqs, run_id="nope", version=1)
    assert e.value.field == "run_id"
    with pytest.raises(InvalidInput) as e:
        engine.compute_logprobs([seqs[0], []], run_id="r", version=1)
    assert e.value.datum_index == 1
    with pytest.raises(InvalidInput) as e:
        engine.compute_logprobs([seqs[0], [1, VOCAB]], run_id="r", version=1)
    assert e.value.datum_index == 1
    assert all_zero(engine.runs["r"].grads)


# ---- one operation in micro-batches ---------------------------------------------------------


def _micro_batches(engine: Engine, run_id: str, data: list[Datum], sizes: list[int], loss_fn: str,
                   config: dict | None = None) -> list[ForwardResult]:
    parts, start = [], 0
    for n in sizes:
        (part,) = engine.run_batch([ForwardRequest(run_id, data[start:start + n], loss_fn, config or {},
                                                   stage="op-1")], backward=True)
        assert isinstance(part, ForwardResult), part
        parts.append(part)
        start += n
    return parts


@pytest.mark.parametrize("loss_fn,config", [("cross_entropy", {}), ("ppo", {"clip_low_threshold": 0.9}),
                                            ("cispo", {})])
def test_micro_batches_equal_one_pass(bases, tiny_qwen3, loss_fn, config):
    """An operation split into micro-batches (gradients staged, then committed) equals one pass: loss,
    every metric (sums add, means weighted by their tokens), per-datum outputs and the gradient."""
    from whitney.engine import merge_results

    engine = new_engine(bases)
    engine.create_run("r", tiny_qwen3, LoraConfig(rank=4, seed=3))
    g = torch.Generator().manual_seed(11)
    train(engine, "r", g)
    data = rl_data(engine, "r", g, [7, 3, 12, 5, 9]) if loss_fn != "cross_entropy" else \
        [ce(g, n, weights=True) for n in (7, 3, 12, 5, 9)]
    engine.forward_backward("r", [ce(g, 4)])  # an earlier operation's gradient is already accumulated
    before = grads_of(engine, "r")
    whole = engine.forward_backward("r", data, loss_fn, config)
    want = grads_of(engine, "r")
    engine.runs["r"].grads.clear()
    engine.runs["r"].grads.update({k: v.clone() for k, v in before.items()})

    parts = _micro_batches(engine, "r", data, [2, 1, 2], loss_fn, config)
    for k, v in before.items():  # nothing reaches the accumulator before the commit
        assert torch.equal(engine.runs["r"].grads[k], v), k
    engine.commit_gradients("r", "op-1")
    merged = merge_results(parts)

    assert not engine.runs["r"].staged
    assert_grads_close(grads_of(engine, "r"), want)
    assert_results_close(merged, whole)
    assert merged.metrics.keys() == whole.metrics.keys()
    for name, value in whole.metrics.items():
        assert merged.metrics[name] == pytest.approx(value, rel=REL, abs=1e-6), name
    if loss_fn == "ppo":  # the means are really weighted: an unweighted mean of the parts differs
        plain = sum(p.metrics["clipped_fraction:mean"] for p in parts) / len(parts)
        assert abs(plain - whole.metrics["clipped_fraction:mean"]) > 1e-4


def test_discarded_micro_batches_leave_no_gradient(bases, tiny_llama):
    engine = new_engine(bases)
    engine.create_run("r", tiny_llama, LoraConfig(rank=4, seed=1))
    g = torch.Generator().manual_seed(12)
    train(engine, "r", g)
    before = snapshot(engine, "r")
    _micro_batches(engine, "r", [ce(g, 5), ce(g, 6)], [1, 1], "cross_entropy")
    assert engine.runs["r"].staged["op-1"]
    engine.discard_gradients("r", "op-1")
    assert not engine.runs["r"].staged
    assert_same_snapshot(engine, "r", before)
