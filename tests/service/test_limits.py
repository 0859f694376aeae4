"""Per-request limits against a real server: each is refused up front with a 413 that states the limit,
nothing is stored, and a request within the limits but above the worker's budget is split into
micro-batches with the same numbers as one pass (the split-batch invariance gate, over HTTP)."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.models import VOCAB
from whitney.service.scheduling.limits import Limits

SMALL = Limits(max_operation_tokens=400, max_operation_datums=8, max_metadata_bytes=200, max_stop_sequences=3,
               max_stop_length=10, max_batch_tokens=64)


def expect(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    return response.json()


def datum(g: torch.Generator, n: int) -> dict:
    s = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
    w = torch.rand(n, generator=g).tolist()
    return {"input": {"token_ids": s[:-1]},
            "loss_inputs": {"target_tokens": {"dtype": "int64", "shape": [n], "values": s[1:]},
                            "weights": {"dtype": "float32", "shape": [n], "values": w}}}


def new_run(http: httpx.Client, **lora) -> str:
    session = expect(http.post("/v1/sessions", json={}), 201)["id"]
    return expect(http.post(f"/v1/sessions/{session}/runs", json={"lora": {"rank": 4, "seed": 7, **lora}}), 201)["id"]


def result(http: httpx.Client, op: dict) -> dict:
    op = expect(http.get(f"/v1/operations/{op['id']}", params={"wait": 30}), 200)
    assert op["status"] == "succeeded", op
    return op["result"]


def test_limits_are_refused_up_front_and_store_nothing(make_server):
    server = make_server(limits=SMALL)
    http = server.http()
    run = new_run(http)
    g = torch.Generator().manual_seed(0)
    cases = [
        ("forward_backward", {"seq_id": 0, "data": [datum(g, 2)] * 9}, "data", "limit is 8"),
        ("forward_backward", {"seq_id": 0, "data": [datum(g, 60)] * 7}, "data", "420 tokens; the limit is 400"),
        ("forward", {"seq_id": 0, "data": [datum(g, 401)]}, "data", "limit is 400"),
    ]
    for route, body, field, text in cases:
        error = expect(http.post(f"/v1/runs/{run}/{route}", json=body), 413)
        assert error["code"] == "too_large" and error["field"] == field and text in error["message"], error
    assert expect(http.get(f"/v1/runs/{run}/operations"), 200) == []
    # seq_id 0 is still free: the same run takes a request within the limits.
    assert result(http, expect(http.post(f"/v1/runs/{run}/forward_backward",
                                         json={"seq_id": 0, "data": [datum(g, 50)] * 8}), 202))["loss"] > 0

    error = expect(http.post("/v1/logprobs", json={"sequences": [[1, 2, 3]] * 9}), 413)
    assert error["field"] == "sequences" and "limit is 8" in error["message"]
    for stop, text in ((["a", "b", "c", "d"], "limit is 3"), (["x" * 11], "limit of 10"), ([list(range(11))], "10")):
        error = expect(http.post("/v1/samples", json={"prompt": [1, 2], "max_tokens": 2, "stop": stop}), 413)
        assert error["field"] == "stop" and text in error["message"], error
    big = {"note": "x" * 300}
    sessions_before = expect(http.get("/v1/sessions"), 200)
    assert expect(http.post("/v1/sessions", json={"user_metadata": big}), 413)["field"] == "user_metadata"
    assert expect(http.get("/v1/sessions"), 200) == sessions_before
    session = sessions_before[0]["id"]
    runs_before = expect(http.get(f"/v1/sessions/{session}/runs"), 200)
    assert expect(http.post(f"/v1/sessions/{session}/runs", json={"user_metadata": big}), 413)["field"] == "user_metadata"
    assert expect(http.get(f"/v1/sessions/{session}/runs"), 200) == runs_before
    caps = expect(http.get("/v1/training/capabilities"), 200)["limits"]
    assert caps["max_operation_tokens"] == 400 and caps["max_batch_tokens"] == 64


def test_tinker_forward_backward_over_the_token_limit_is_a_413(make_server):
    import tinker
    from tinker import types

    server = make_server(limits=SMALL)
    client = tinker.ServiceClient(base_url=server.url, api_key="tml-test")
    base = client.get_server_capabilities().supported_models[0].model_name
    training = client.create_lora_training_client(base_model=base, rank=4)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (402,), generator=g).tolist()
    data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * 401})]
    with pytest.raises(Exception) as info:
        training.forward_backward(data, "cross_entropy").result(timeout=60)
    assert "413" in str(info.value) or "limit is 400" in str(info.value), info.value


def test_split_operation_over_http_equals_one_pass(make_server):
    """The same run and batch on a server whose budget splits it into micro-batches and on one that does
    not: equal loss, log-probs, optimizer metrics and, after the step, equal log-probs."""
    g = torch.Generator().manual_seed(2)
    data = [datum(g, n) for n in (30, 17, 45, 8, 26)]
    probe = [datum(g, 12)]
    out = []
    for limits in (Limits(max_batch_tokens=40), Limits()):
        http = make_server(limits=limits).http()
        run = new_run(http)
        fb = result(http, expect(http.post(f"/v1/runs/{run}/forward_backward", json={"seq_id": 0, "data": data}), 202))
        step = result(http, expect(http.post(f"/v1/runs/{run}/optim_step",
                                             json={"seq_id": 1, "adam_params": {"learning_rate": 0.01}}), 202))
        after = result(http, expect(http.post(f"/v1/runs/{run}/forward", json={"seq_id": 2, "data": probe}), 202))
        out.append((fb, step, after))
    (fb, step, after), (fb1, step1, after1) = out
    assert fb["loss"] == pytest.approx(fb1["loss"], rel=1e-5)
    assert fb["metrics"] == pytest.approx(fb1["metrics"], rel=1e-5)
    for a, b in zip(fb["outputs"], fb1["outputs"]):
        torch.testing.assert_close(torch.tensor(a["logprobs"]), torch.tensor(b["logprobs"]), rtol=1e-5, atol=1e-6)
    assert step["metrics"]["grad_norm"] == pytest.approx(step1["metrics"]["grad_norm"], rel=1e-5)
    torch.testing.assert_close(torch.tensor(after["outputs"][0]["logprobs"]),
                               torch.tensor(after1["outputs"][0]["logprobs"]), rtol=1e-4, atol=1e-5)
