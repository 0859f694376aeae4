"""Issue 31, item 11: an optim_step whose accumulated gradient is not finite is refused behind a real server (a
user's error, naming the run and where), the run's weights kept bitwise and its gradient dropped, so it trains on;
another run is untouched."""

from __future__ import annotations

from tests.engine.test_custom_loss import definition
from tests.engine.test_optim_steps import _nan_loss
from tests.service.test_flow import LORA, expect, sft_batch
from whitney import Client
from whitney.datums import tensor


def test_a_nan_gradient_refuses_the_step_keeps_the_weights_and_the_run_trains_on(make_server):
    server = make_server()
    http = server.http()
    loss_id = expect(http.post("/v1/custom_losses", json=definition(_nan_loss, {"logprobs": 1})), 201)["id"]
    client = Client(server.url)
    run, other = (client.create_session().create_run(**LORA, seed=3 + i) for i in range(2))
    for r in (run, other):
        r.forward_backward(sft_batch()).result()
        r.optim_step(learning_rate=1e-2).result()
    probe = run.forward(sft_batch()).result()
    nan_data = [{"input": {"token_ids": [5, 17, 42, 8]}, "loss_inputs": {"target_tokens": tensor([17, 42, 8, 99],
                                                                                                  "int64")}}]
    run.forward_backward(nan_data, "custom", loss_id=loss_id).wait(60)
    other.forward_backward(sft_batch()).result()
    refused, stepped = run.optim_step(learning_rate=1e-2).wait(60), other.optim_step(learning_rate=1e-2).wait(60)
    assert refused["status"] == "failed", refused
    error = refused["error"]
    assert error["code"] == "invalid_input" and error.get("category", "user") == "user", error
    assert f"run {run.id!r}" in error["message"] and "not finite" in error["message"], error
    assert "layers." in error["message"] and "dropped" in error["message"], error
    assert stepped["status"] == "succeeded" and stepped["result"]["metrics"]["step"] == 2.0, stepped
    assert run.forward(sft_batch()).result() == probe, "the weights are unchanged"
    assert run.refresh()["status"] == "active", run.info
    run.forward_backward(sft_batch()).result()  # the NaN gradient was dropped: only this one is stepped
    metrics = run.optim_step(learning_rate=1e-2).result()["metrics"]
    assert metrics["step"] == 2.0 and 0 < metrics["grad_norm"] < float("inf"), metrics
