"""The wire protocol at the HTTP level, where the SDK hides it: long polls, seq_id order, auth, heartbeats."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker import types

from tests.service.conftest import start_server
from tests.tinker.conftest import API_KEY
from tests.tinker.helpers import arrays, tinker_data
from whitney.service.app import ServiceConfig
from whitney.service.tinker import futures


def raw(url: str, key: str = API_KEY) -> httpx.Client:
    return httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def fb_body(model_id: str, seq_id: int) -> bytes:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=tinker_data(arrays("cross_entropy")),
                                                          loss_fn="cross_entropy"),
        model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def test_out_of_order_requests_wait_for_their_turn(tinker_env, tiny_llama, monkeypatch):
    """seq 3 arrives first and is pending (408 try_again) until 1 and 2 have arrived and run."""
    monkeypatch.setattr(futures, "MAX_WAIT", 0.2)
    proto = {"Content-Type": "application/x-protobuf"}
    with raw(tinker_env.url) as http:
        session_id = http.post("/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "x"}
                               ).json()["session_id"]
        created = http.post("/create_model", json={"session_id": session_id, "model_seq_id": 0,
                                                   "base_model": tiny_llama, "lora_config": {"rank": 4, "seed": 1},
                                                   "future_field": "ignored"}).json()
        model_id = created["model_id"]
        assert model_id == f"{session_id}:train:0"
        third = http.post("/forward_backward", content=fb_body(model_id, 3), headers=proto).json()["request_id"]
        pending = http.post("/retrieve_future", json={"request_id": third})
        assert pending.status_code == 408 and pending.json()["type"] == "try_again"
        second = http.post("/optim_step", json={"model_id": model_id, "seq_id": 2,
                                                "adam_params": {"learning_rate": 0.01, "grad_clip_norm": 0.0}})
        first = http.post("/forward_backward", content=fb_body(model_id, 1), headers=proto).json()["request_id"]
        monkeypatch.setattr(futures, "MAX_WAIT", 30.0)
        results = [http.post("/retrieve_future", json={"request_id": r}) for r in
                   (first, second.json()["request_id"], third)]
        assert [r.status_code for r in results] == [200, 200, 200]
        assert results[0].headers["content-type"] == "application/x-protobuf"
        assert "grad_norm" in results[1].json()["metrics"]
        from tinker.proto.response_conv import deserialize_forward_backward_output

        before, after = (deserialize_forward_backward_output(r.content) for r in (results[0], results[2]))
        assert before.metrics["loss:sum"] != after.metrics["loss:sum"]  # the step ran between them
        assert np.isfinite(after.metrics["loss:sum"])
        # The session ends: heartbeats are then answered 410, which stops the SDK's heartbeat loop.
        assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 200
        assert http.post(f"/sessions/{session_id}/finish", json={"reason": {"type": "success"}}).status_code == 200
        assert http.post("/session_heartbeat", json={"session_id": session_id}).status_code == 410


def test_api_keys(tmp_path, tiny_llama):
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path / "data", api_keys=[API_KEY]))
    try:
        with raw(server.url) as http:
            assert http.post("/create_session", json={"tags": []}).status_code == 200
        with raw(server.url, "tml-wrong") as http:
            assert http.post("/create_session", json={"tags": []}).status_code == 401
    finally:
        server.stop()


@pytest.mark.parametrize("body,status", [
    ({"model_id": "ses-x:train:0", "seq_id": 1, "adam_params": {}}, 404),
    ({"model_id": "ses-x:train:0", "seq_id": 0, "adam_params": {}}, 400),
])
def test_bad_requests_are_4xx(tinker_env, body, status):
    with raw(tinker_env.url) as http:
        assert http.post("/optim_step", json=body).status_code == status
