"""The SDK's RestClient and the protocol's edges: runs, checkpoints, weights info, sessions, retries, futures."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.tinker.conftest import API_KEY
from tests.tinker.helpers import arrays, tinker_data

RANK, SEED = 4, 2


@pytest.fixture(scope="module")
def model(service_client, tiny_llama):
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED,
                                                    user_metadata={"renderer_name": "role_colon"}).result()
    tc.forward_backward(tinker_data(arrays("cross_entropy")), "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2))
    state = tc.save_state("ckpt-1").result().path
    sampler = tc.save_weights_for_sampler("for-eval").result().path
    return {"tc": tc, "state": state, "sampler": sampler}


@pytest.fixture(scope="module")
def rest(service_client):
    return service_client.create_rest_client()


def test_get_training_run_echoes_user_metadata(rest, model, tiny_llama):
    run = rest.get_training_run(model["tc"].model_id).result()
    assert run.training_run_id == model["tc"].model_id and run.base_model == tiny_llama
    assert run.user_metadata == {"renderer_name": "role_colon"}
    assert run.is_lora and run.lora_rank == RANK
    assert run.last_checkpoint.tinker_path == model["state"]
    assert run.last_sampler_checkpoint.tinker_path == model["sampler"]
    assert rest.get_training_run_by_tinker_path(model["state"]).result().training_run_id == model["tc"].model_id
    listed = rest.list_training_runs(limit=1000).result().training_runs  # every run of the shared server
    assert model["tc"].model_id in [r.training_run_id for r in listed]


def test_list_and_delete_checkpoints(rest, model):
    tc = model["tc"]
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    by_id = {c.checkpoint_id: c for c in listed}
    assert by_id["weights/ckpt-1"].checkpoint_type == "training"
    assert by_id["weights/ckpt-1"].tinker_path == model["state"]
    assert by_id["sampler_weights/for-eval"].checkpoint_type == "sampler"
    assert {c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints} >= {model["state"],
                                                                                        model["sampler"]}
    extra = tc.save_state("to-delete").result().path
    rest.delete_checkpoint(tc.model_id, "weights/to-delete").result()  # the id holds a slash
    assert "weights/to-delete" not in {c.checkpoint_id for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(extra).result()


def test_weights_info(rest, model, tiny_llama):
    info = rest.get_weights_info_by_tinker_path(model["state"]).result()
    assert info.base_model == tiny_llama and info.is_lora and info.lora_rank == RANK
    assert info.train_attn and info.train_mlp and info.train_unembed


def test_server_capabilities_and_sessions(rest, service_client, model, tiny_llama):
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [Path(tiny_llama).name]  # no server path
    with pytest.warns(FutureWarning):
        assert service_client.get_server_capabilities().supported_models[0].max_context_length > 0
    session_id = service_client.holder.get_session_id()
    session = rest.get_session(session_id).result()
    assert model["tc"].model_id in session.training_run_ids
    assert session_id in rest.list_sessions().result().sessions


def test_get_sampler(rest, service_client, model):
    service_client.create_sampling_client(model_path=model["sampler"]).result()
    sampler_ids = rest.get_session(service_client.holder.get_session_id()).result().sampler_ids
    infos = [rest.get_sampler(sampler_id).result() for sampler_id in sampler_ids]
    assert model["sampler"] in [info.model_path for info in infos]


def test_save_state_without_overwrite_refuses_an_existing_name(model):
    tc = model["tc"]
    with pytest.raises(tinker.RequestFailedError, match="overwrite"):
        tc.save_state("ckpt-1").result()
    assert tc.save_state("ckpt-1", overwrite=True).result().path == model["state"]


def raw(server) -> httpx.Client:
    return httpx.Client(base_url=f"{server.url}/api/v1", headers={"X-API-Key": API_KEY}, timeout=60)


def test_a_resent_request_is_the_same_operation(tinker_env, service_client, tiny_llama):
    """The SDK resends with the same seq_id after a network error: the server answers the first request."""
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    with raw(tinker_env) as http:
        body = {"model_id": tc.model_id, "seq_id": 1, "adam_params": {"learning_rate": 1e-2}}
        first = http.post("/optim_step", json=body)
        again = http.post("/optim_step", json=body)
        assert first.status_code == again.status_code == 200
        assert first.json()["request_id"] == again.json()["request_id"]
        clash = http.post("/optim_step", json={**body, "adam_params": {"learning_rate": 2e-2}})
        assert clash.status_code == 400  # never a 409: the SDK would retry it for minutes
        assert http.post("/retrieve_future", json={"request_id": "op-nope"}).status_code == 404
        # whoami reads the JWT; create_custom_loss uploads the traced loss
        assert http.post("/client/config", json={}).json() == {"pjwt_auth_enabled": True,
                                                               "custom_loss_server_side": True}


def test_unknown_model_and_session_are_404(tinker_env):
    with raw(tinker_env) as http:
        assert http.post("/get_info", json={"model_id": "ses-x:train:0"}).status_code == 404
        assert http.post("/session_heartbeat", json={"session_id": "ses-nope"}).status_code == 404
        assert http.post("/sessions/ses-nope/finish", json={}).status_code == 404


def test_with_block_finishes_the_session(tinker_env, tiny_llama):
    store = tinker_env.app.state.whitney.store
    with tinker.ServiceClient() as client:
        tc = client.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
        tc.forward_backward(tinker_data(arrays("cross_entropy")), "cross_entropy").result()
        session_id = client.holder.get_session_id()
    assert store.get_session(session_id, store.get_run(tc.model_id).owner).status == "closed"
    assert store.get_run(tc.model_id).status == "finished"
    assert [op.status for op in store.list_operations(tc.model_id)] == ["succeeded"]
    other = tinker.ServiceClient()
    other.create_lora_training_client(base_model=tiny_llama, rank=RANK, seed=SEED).result()
    session_id = other.holder.get_session_id()
    other.close("errored", detail="explicit close").result()
    assert store.get_session(session_id, store.get_run(tc.model_id).owner).status == "closed"
