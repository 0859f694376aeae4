"""The official tinker SDK's TrainingClient against a real Whitney server, checked against the native API.

The same LoRA seed, data and optimizer settings through the SDK and through whitney.Client must give
the same losses and log-probs (rtol 1e-5): both go to the same engine, so any difference is a
protocol bug (a dropped field, a wrong default, a lost sign).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import whitney
from tests.tinker.helpers import RTOL, arrays, close, native_data, sdk_logprobs, tinker_data

RANK, SEED = 4, 11


@pytest.fixture(scope="module")
def native(tinker_env):
    native_client = whitney.Client(tinker_env.url)
    native_session = native_client.create_session()
    yield native_session
    native_session.close()
    native_client.close()


def pair(service_client, native, tiny_llama, **lora):
    """A Tinker training client and a native run with the same LoRA initialisation."""
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED, **lora).result()
    run = native.create_run(tiny_llama, rank=RANK, seed=SEED, alpha=32.0, **lora)
    return tc, run


def test_create_lora_training_client_and_info(service_client, tiny_llama, tinker_env):
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED, train_mlp=False,
                                                    train_unembed=False, user_metadata={"renderer_name": "x"}
                                                    ).result()
    session_id = service_client.holder.get_session_id()
    assert tc.model_id.startswith(f"{session_id}:train:")
    info = tc.get_info()
    assert info.model_id == tc.model_id and info.lora_rank == RANK and info.model_data.model_name == tiny_llama
    run = tinker_env.app.state.whitney.store.get_run(tc.model_id)
    assert run.lora["train_mlp"] is False and run.lora["train_unembed"] is False and run.lora["seed"] == SEED
    assert run.user_metadata == {"renderer_name": "x"}
    tokenizer = tc.get_tokenizer()  # the model's local directory, offline
    assert tokenizer.decode(tokenizer.encode("hello world")).strip() == "hello world"


LOSSES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", None),
    ("cispo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
    ("dro", {"beta": 0.3}),
    ("gspo", None),
    ("gspo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
]


@pytest.mark.parametrize("loss_fn,config", LOSSES, ids=[f"{n}-{bool(c)}" for n, c in LOSSES])
def test_forward_backward_and_optim_step_match_native(service_client, native, tiny_llama, loss_fn, config):
    tc, run = pair(service_client, native, tiny_llama)
    items = arrays(loss_fn, rng_seed=len(loss_fn))
    native_config = dict(config or {})
    if loss_fn == "cispo" and not config:  # Tinker's cispo defaults are absolute bounds 0.8 / 1.2
        native_config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    fb = tc.forward_backward(tinker_data(items), loss_fn, config)
    step = tc.optim_step(__import__("tinker").types.AdamParams(learning_rate=1e-2, grad_clip_norm=0.5,
                                                               weight_decay=0.01))
    expected = run.forward_backward(native_data(items), loss_fn, **native_config).result()
    native_step = run.optim_step(learning_rate=1e-2, gradient_clip_norm=0.5, weight_decay=0.01).result()
    got = fb.result()
    assert set(got.metrics) >= {"loss:sum"} and all(k.count(":") == 1 for k in got.metrics)
    close(got.metrics["loss:sum"], expected["loss"])
    for lp, out in zip(sdk_logprobs(got), expected["outputs"]):
        close(lp, out["logprobs"])
    close(step.result().metrics["grad_norm"], native_step["metrics"]["grad_norm"])
    # After the step (clipped, with weight decay) both adapters moved the same way.
    after = tc.forward(tinker_data(items), loss_fn, config).result()
    native_after = run.forward(native_data(items), loss_fn, **native_config).result()
    close(after.metrics["loss:sum"], native_after["loss"])
    for lp, out in zip(sdk_logprobs(after), native_after["outputs"]):
        close(lp, out["logprobs"])


def test_soft_targets_2d_sparse(service_client, native, tiny_llama):
    """2-D target_tokens / weights as torch tensors: the SDK sends them as sparse CSR."""
    tc, run = pair(service_client, native, tiny_llama)
    tokens = [1, 17, 250, 4000, 12, 99]
    n, k = len(tokens) - 1, 8
    targets = torch.zeros(n, k, dtype=torch.int64)
    weights = torch.zeros(n, k)
    targets[:, 0] = torch.tensor(tokens[1:])
    weights[:, 0] = 0.7
    targets[1, 2], weights[1, 2] = 321, 0.3  # a few extra candidates: sparse
    targets[3, 1], weights[3, 1] = 42, 0.3
    from tinker import types

    datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": targets, "weights": weights})
    assert datum.loss_fn_inputs["target_tokens"].sparse_crow_indices is not None
    got = tc.forward_backward([datum], "cross_entropy").result()
    expected = run.forward_backward([{"input": {"token_ids": tokens[:-1]}, "loss_inputs": {
        "target_tokens": {"dtype": "int64", "shape": [n, k], "values": targets.flatten().tolist()},
        "weights": {"dtype": "float32", "shape": [n, k], "values": weights.flatten().tolist()}}}]).result()
    close(got.metrics["loss:sum"], expected["loss"])
    close(sdk_logprobs(got)[0], expected["outputs"][0]["logprobs"])


def test_forward_backward_custom_matches_native(service_client, native, tiny_llama):
    tc, run = pair(service_client, native, tiny_llama)
    items = arrays("cross_entropy")

    def loss_fn(data, logprobs):
        loss = sum((lp.double() ** 2).sum() * (i + 1) for i, lp in enumerate(logprobs))
        return loss, {"custom:sum": float(loss)}

    got = tc.forward_backward_custom(tinker_data(items), loss_fn).result()
    tc.optim_step(__import__("tinker").types.AdamParams(learning_rate=1e-2)).result()
    expected = run.forward_backward_custom(native_data(items), loss_fn)
    run.optim_step(learning_rate=1e-2).result()
    close(got.metrics["loss:sum"], expected["loss"])
    after = tc.forward(tinker_data(items), "cross_entropy").result()
    native_after = run.forward(native_data(items)).result()
    for lp, out in zip(sdk_logprobs(after), native_after["outputs"]):
        close(lp, out["logprobs"], rtol=RTOL)


def test_user_errors_fail_their_future_and_do_not_block_later_requests(service_client, tiny_llama):
    import tinker

    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    items = arrays("cross_entropy")
    bad = tc.forward_backward(tinker_data(items), "no_such_loss")
    with pytest.raises(tinker.RequestFailedError) as info:
        bad.result()
    assert info.value.category == tinker.types.RequestErrorCategory.User
    assert "no_such_loss" in str(info.value)
    # The failed request held its seq_id; a later one still runs (on a fresh client: the SDK poisons a
    # client whose request failed only for custom losses, so this one goes on).
    ok = tc.forward(tinker_data(items), "cross_entropy").result()
    assert np.isfinite(ok.metrics["loss:sum"])


def test_state_round_trip(service_client, tiny_llama):
    from tinker import types

    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    items = arrays("cross_entropy")
    tc.forward_backward(tinker_data(items), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("step1").result().path
    assert path == f"tinker://{tc.model_id}/weights/step1"
    saved = sdk_logprobs(tc.forward(tinker_data(items), "cross_entropy").result())

    def train_once(client):
        client.forward_backward(tinker_data(items), "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        return sdk_logprobs(client.forward(tinker_data(items), "cross_entropy").result())

    continued = train_once(tc)  # the reference: one more step with the optimizer state
    assert tc.load_state(path).result().path == path
    close(sdk_logprobs(tc.forward(tinker_data(items), "cross_entropy").result()), saved)
    assert tc.load_state_with_optimizer(path).result().path == path
    close(train_once(tc), continued)

    weights_only = service_client.create_training_client_from_state(path).result()
    assert weights_only.model_id.endswith(":train:" + weights_only.model_id.rsplit(":", 1)[1])
    assert weights_only.get_info().lora_rank == RANK
    close(sdk_logprobs(weights_only.forward(tinker_data(items), "cross_entropy").result()), saved)
    with_optimizer = service_client.create_training_client_from_state_with_optimizer(path).result()
    close(train_once(with_optimizer), continued)
    fresh_optimizer = train_once(weights_only)
    assert not np.allclose(np.concatenate(fresh_optimizer), np.concatenate(continued), rtol=RTOL)  # it did reset
