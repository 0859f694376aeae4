"""Datum validation: every rejected input names the field, the datum index and (for shapes) expected vs actual.

The bad datum is put at index 2 (after two good ones) so datum_index is checked, not defaulted.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.models import VOCAB
from whitney.engine import Datum, Engine, LoraConfig, TensorInput
from whitney.engine.losses.builtin import loss_spec
from whitney.engine.losses.datum import prepare_datum
from whitney.errors import InvalidInput

N = 5
TOKENS = [11, 12, 13, 14, 15]
TARGETS = [12, 13, 14, 15, 16]
RL = {"old_logprobs": [-1.0] * N, "advantages": [0.5, -0.5, 1.0, 0.0, 2.0]}


@pytest.fixture(scope="module")
def engine(tiny_llama):
    engine = Engine()
    engine.create_run("r", tiny_llama, LoraConfig(rank=2, seed=1))
    return engine


def good(loss_fn: str = "cross_entropy") -> Datum:
    inputs = {"target_tokens": list(TARGETS)}
    if loss_fn != "cross_entropy":
        inputs.update({k: list(v) for k, v in RL.items()})
    return Datum(list(TOKENS), inputs)


def rejected(engine: Engine, bad: Datum, loss_fn: str = "cross_entropy", index: int = 2) -> InvalidInput:
    """Forward [good, good, bad] (bad at `index`), expect InvalidInput, return it."""
    data = [good(loss_fn) for _ in range(index)] + [bad]
    with pytest.raises(InvalidInput) as e:
        engine.forward("r", data, loss_fn)
    err = e.value
    assert err.datum_index == index, err.to_dict()
    if index is not None:
        assert err.message.startswith(f"datum {index}:"), err.message
    # A rejected request computes nothing and leaves no gradient.
    assert all(float(g.abs().max()) == 0 for g in engine.runs["r"].grads.values())
    return err


# ---- token_ids -----------------------------------------------------------------------------


def test_empty_token_ids(engine):
    err = rejected(engine, Datum([], {"target_tokens": []}))
    assert err.field == "token_ids" and "empty" in err.message


def test_empty_token_chunks(engine):
    err = rejected(engine, Datum([[], []], {"target_tokens": []}))
    assert err.field == "token_ids" and "empty" in err.message


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_token_id_outside_vocab_in_token_ids(engine, bad):
    tokens = list(TOKENS)
    tokens[3] = bad
    err = rejected(engine, Datum(tokens, {"target_tokens": list(TARGETS)}))
    assert err.field == "token_ids"
    assert str(bad) in err.message and "position 3" in err.message and f"[0, {VOCAB})" in err.message


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_token_id_outside_vocab_in_target_tokens(engine, bad):
    targets = list(TARGETS)
    targets[1] = bad
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": targets}))
    assert err.field == "target_tokens"
    assert str(bad) in err.message and "position 1" in err.message


@pytest.mark.parametrize("bad", [-1, VOCAB])
def test_token_id_outside_vocab_in_soft_targets(engine, bad):
    targets = [[t, t + 1] for t in TARGETS]
    targets[4][1] = bad
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": targets}))
    assert err.field == "target_tokens" and str(bad) in err.message


@pytest.mark.parametrize("bad", [1.5, True, "7", None])
def test_non_integer_token_ids(engine, bad):
    tokens = list(TOKENS)
    tokens[0] = bad
    err = rejected(engine, Datum(tokens, {"target_tokens": list(TARGETS)}))
    assert err.field == "token_ids"


def test_token_ids_not_a_list(engine):
    err = rejected(engine, Datum("11 12 13", {"target_tokens": [1, 2, 3]}))
    assert err.field == "token_ids"


def test_tokens_beyond_context(engine):
    ctx = engine.runs["r"].base.config.max_context
    assert ctx == 512
    err = rejected(engine, Datum([3] * (ctx + 1), {"target_tokens": [3] * (ctx + 1)}))
    assert err.field == "token_ids" and str(ctx + 1) in err.message and str(ctx) in err.message
    # Exactly the context is accepted (validation only: no forward of 512 tokens).
    spec = loss_spec("cross_entropy")
    ok = prepare_datum(Datum([3] * ctx, {"target_tokens": [3] * ctx}), 0, spec.inputs, set(spec.required), VOCAB, ctx)
    assert ok.length == ctx


def test_token_chunks_are_concatenated(engine):
    flat = engine.forward("r", [Datum(list(TOKENS), {"target_tokens": list(TARGETS)})])
    chunked = engine.forward("r", [Datum([TOKENS[:2], TOKENS[2:3], TOKENS[3:]], {"target_tokens": list(TARGETS)})])
    assert chunked.loss == flat.loss
    assert chunked.outputs[0].logprobs == flat.outputs[0].logprobs
    assert len(chunked.outputs[0].logprobs) == N
    # A chunk boundary moved is a different sequence only if the tokens differ: same tokens, same result.
    other = engine.forward("r", [Datum([TOKENS[:4], TOKENS[4:]], {"target_tokens": list(TARGETS)})])
    assert other.outputs[0].logprobs == flat.outputs[0].logprobs


# ---- target_tokens and weights -------------------------------------------------------------


@pytest.mark.parametrize("length", [N - 1, N + 1])
def test_target_tokens_length_mismatch(engine, length):
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": [12] * length}))
    assert err.field == "target_tokens"
    assert f"[{N}]" in err.message and f"[{length}]" in err.message


def test_target_tokens_wrong_rank(engine):
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": [[[1]] * N]}))
    assert err.field == "target_tokens" and f"[1, {N}, 1]" in err.message and f"[{N}]" in err.message


def test_rl_target_tokens_must_be_1d(engine):
    bad = good("ppo")
    bad.loss_inputs["target_tokens"] = [[t, t] for t in TARGETS]
    err = rejected(engine, bad, "ppo")
    assert err.field == "target_tokens" and f"[{N}, 2]" in err.message


@pytest.mark.parametrize("form", ["list", "tensor_input", "dict"])
def test_float_target_tokens_refused(engine, form):
    values = [float(t) for t in TARGETS]
    value = {"list": values, "tensor_input": TensorInput("float32", [N], values),
             "dict": {"dtype": "float64", "shape": [N], "values": values}}[form]
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": value}))
    assert err.field == "target_tokens" and "int" in err.message


def test_fractional_values_under_int_dtype_refused(engine):
    """int64 values of 12.5 must not be truncated silently to 12."""
    values = [float(t) for t in TARGETS]
    values[2] = 14.5
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": TensorInput("int64", [N], values)}))
    assert err.field == "target_tokens"


def test_weights_length_mismatch(engine):
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": list(TARGETS), "weights": [1.0] * (N + 2)}))
    assert err.field == "weights" and f"[{N}]" in err.message and f"[{N + 2}]" in err.message


def test_soft_target_weights_k_mismatch(engine):
    targets = [[t, t + 1, t + 2] for t in TARGETS]  # [N, 3]
    weights = [[0.5, 0.5] for _ in TARGETS]  # [N, 2]
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": targets, "weights": weights}))
    assert err.field == "weights"
    assert f"[{N}, 2]" in err.message and f"[{N}, 3]" in err.message


def test_flat_weights_with_soft_targets_refused(engine):
    targets = [[t, t + 1] for t in TARGETS]
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": targets, "weights": [1.0] * N}))
    assert err.field == "weights" and f"[{N}]" in err.message and f"[{N}, 2]" in err.message


@pytest.mark.parametrize("field,loss_fn", [("weights", "cross_entropy"), ("advantages", "ppo"),
                                           ("old_logprobs", "ppo"), ("old_logprobs", "importance_sampling")])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_values(engine, field, loss_fn, bad):
    datum = good(loss_fn)
    values = [1.0] * N if field == "weights" else list(datum.loss_inputs[field])
    values[3] = bad
    datum.loss_inputs[field] = values
    err = rejected(engine, datum, loss_fn)
    assert err.field == field and "NaN or infinite" in err.message


def test_non_finite_in_tensor_input(engine):
    datum = good("ppo")
    datum.loss_inputs["advantages"] = {"dtype": "float32", "shape": [N], "values": [0.0, 0.0, math.nan, 0.0, 0.0]}
    err = rejected(engine, datum, "ppo")
    assert err.field == "advantages"


def test_ragged_nested_list(engine):
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": [[1, 2], [3], [4, 5], [6, 7], [8, 9]]}))
    assert err.field == "target_tokens" and "rectangular" in err.message


# ---- loss input names ----------------------------------------------------------------------


def test_unknown_loss_input_name(engine):
    datum = good()
    datum.loss_inputs["advantages"] = [1.0] * N  # not an input of cross_entropy
    err = rejected(engine, datum)
    assert err.field == "advantages"
    assert "weights" in err.message and "target_tokens" in err.message  # lists what the loss takes


def test_missing_advantages_for_rl_loss(engine):
    datum = good("ppo")
    del datum.loss_inputs["advantages"]
    err = rejected(engine, datum, "ppo")
    assert err.field == "advantages" and "required" in err.message


def test_missing_target_tokens(engine):
    err = rejected(engine, Datum(list(TOKENS), {"weights": [1.0] * N}))
    assert err.field == "target_tokens" and "required" in err.message


@pytest.mark.parametrize("first", ["old_logprobs", "logprobs"])
def test_both_logprobs_and_old_logprobs(engine, first):
    datum = good("ppo")
    old = datum.loss_inputs.pop("old_logprobs")
    second = "logprobs" if first == "old_logprobs" else "old_logprobs"
    datum.loss_inputs[first] = list(old)
    datum.loss_inputs[second] = list(old)
    err = rejected(engine, datum, "ppo")
    assert err.field in ("logprobs", "old_logprobs")
    assert "'logprobs'" in err.message and "'old_logprobs'" in err.message, err.message


def test_logprobs_is_alias_of_old_logprobs(engine):
    old = [-0.5, -9.0, -11.0, -10.5, -12.0]
    canonical = good("ppo")
    canonical.loss_inputs["old_logprobs"] = list(old)
    aliased = good("ppo")
    del aliased.loss_inputs["old_logprobs"]
    aliased.loss_inputs["logprobs"] = list(old)
    a = engine.forward("r", [canonical], "ppo")
    b = engine.forward("r", [aliased], "ppo")
    assert a.loss == b.loss and a.outputs[0].elementwise_loss == b.outputs[0].elementwise_loss
    # old_logprobs matter, so the alias is really read (not defaulted).
    other = good("ppo")
    assert engine.forward("r", [other], "ppo").loss != a.loss


# ---- wire tensors --------------------------------------------------------------------------


def test_dict_values_do_not_fill_shape(engine):
    weights = {"dtype": "float32", "shape": [N, 2], "values": [1.0] * N}
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": list(TARGETS), "weights": weights}))
    assert err.field == "weights" and f"[{N}, 2]" in err.message and str(N) in err.message


def test_tensor_input_values_do_not_fill_shape(engine):
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": TensorInput("int64", [N + 1], list(TARGETS))}))
    assert err.field == "target_tokens" and f"[{N + 1}]" in err.message


@pytest.mark.parametrize("dtype", ["bfloat16", "int8", "float", ""])
def test_unknown_dtype(engine, dtype):
    weights = {"dtype": dtype, "shape": [N], "values": [1.0] * N}
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": list(TARGETS), "weights": weights}))
    assert err.field == "weights" and "dtype" in err.message and repr(dtype) in err.message


def test_dict_with_unknown_key(engine):
    weights = {"dtype": "float32", "shape": [N], "values": [1.0] * N, "data": []}
    err = rejected(engine, Datum(list(TOKENS), {"target_tokens": list(TARGETS), "weights": weights}))
    assert err.field == "weights"


def test_wire_forms_give_the_same_result(engine):
    weights = [0.5, 1.0, 0.0, 2.0, -1.0]
    as_lists = engine.forward("r", [Datum(list(TOKENS), {"target_tokens": list(TARGETS), "weights": weights})])
    as_tensors = engine.forward("r", [Datum(list(TOKENS), {
        "target_tokens": TensorInput("int64", [N], list(TARGETS)),
        "weights": {"dtype": "float32", "shape": [N], "values": weights}})])
    assert as_lists.loss == as_tensors.loss
    assert as_lists.outputs[0].elementwise_loss == as_tensors.outputs[0].elementwise_loss


# ---- request level -------------------------------------------------------------------------


def test_empty_data_list(engine):
    with pytest.raises(InvalidInput) as e:
        engine.forward("r", [])
    assert e.value.field == "data" and e.value.datum_index is None


def test_mixed_hard_and_soft_targets_in_one_request(engine):
    soft = Datum(list(TOKENS), {"target_tokens": [[t, t + 1] for t in TARGETS]})
    err = rejected(engine, soft)  # [N], [N], [N, 2]
    assert err.field == "target_tokens"
    assert "[N]" in err.message and "[N, K]" in err.message


def test_soft_targets_with_different_k_in_one_request(engine):
    data = [Datum(list(TOKENS), {"target_tokens": [[t, t + 1] for t in TARGETS]}) for _ in range(2)]
    data.append(Datum(list(TOKENS), {"target_tokens": [[t, t + 1, t + 2] for t in TARGETS]}))
    with pytest.raises(InvalidInput) as e:
        engine.forward("r", data)
    assert e.value.field == "target_tokens" and e.value.datum_index == 2


def test_unknown_loss_fn(engine):
    with pytest.raises(InvalidInput) as e:
        engine.forward("r", [good()], "mse")
    assert e.value.field == "loss_fn" and "cross_entropy" in e.value.message


def test_valid_datums_pass_and_shapes_follow_n(engine):
    """The control: the good datums used above are accepted, of every supported form."""
    soft = Datum(list(TOKENS), {"target_tokens": [[t, t + 1] for t in TARGETS],
                                "weights": [[0.25, 0.75]] * N})
    cases = (([good(), good()], "cross_entropy"), ([good("ppo")] * 2, "ppo"), ([soft, soft], "cross_entropy"))
    for data, loss in cases:
        out = engine.forward("r", data, loss)
        assert [len(o.logprobs) for o in out.outputs] == [N, N]
        assert all(math.isfinite(x) for o in out.outputs for x in o.logprobs)
    assert torch.isfinite(torch.tensor(out.loss))
