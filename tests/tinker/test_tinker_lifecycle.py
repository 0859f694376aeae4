"""The SDK's checkpoint lifecycle and session bookkeeping against a real server: TTLs (expired checkpoints are
deleted by the server), checkpoint user_metadata, publish/unpublish across API keys, copy_weights (within a
key, and across keys with a weights access token), save_weights_external with its download URLs (a PEFT
adapter that loads with peft), session tags/project/display name and search_sessions, whoami, session
traces and the audit log. Whitney's side is read through the native API where there is a number to check.
"""

from __future__ import annotations

import asyncio
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from tests.service.conftest import start_server
from tests.tinker.helpers import arrays, tinker_data
from whitney.service.app import ServiceConfig

K1, K2 = "tml-lifecycle-key-one", "tml-lifecycle-key-two"


def trained(service_client, tiny_llama, **kwargs):
    tc = service_client.create_lora_training_client(base_model=tiny_llama, rank=4, seed=5, **kwargs).result()
    tc.forward_backward(tinker_data(arrays("cross_entropy")), "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    return tc


def loss(tc) -> float:
    """The summed cross-entropy of the test datums under the client's weights."""
    return tc.forward(tinker_data(arrays("cross_entropy")), "cross_entropy").result().metrics["loss:sum"]


@pytest.fixture(scope="module")
def keyed(tmp_path_factory, tiny_llama):
    """A server with two API keys, and a ServiceClient and RestClient for each."""
    server = start_server(ServiceConfig(models=[tiny_llama], api_keys=[K1, K2],
                                        data_dir=tmp_path_factory.mktemp("keyed") / "data"))
    clients = {k: tinker.ServiceClient(base_url=server.url, api_key=k, project_id="proj-a", display_name="keyed run")
               for k in (K1, K2)}
    rests = {k: tinker.RestClient(base_url=server.url, api_key=k) for k in (K1, K2)}
    yield {"server": server, "service": clients, "rest": rests}
    for c in clients.values():
        c.close("success").result()
    server.stop()


def test_ttl_and_user_metadata(tinker_env, service_client, tiny_llama, monkeypatch):
    # The reaper at each idle turn of the worker loop (not every 5 s), for the short TTL at the end.
    monkeypatch.setattr(tinker_env.app.state.whitney.scheduler.reaper, "expiry_interval", 0.05)
    tc = trained(service_client, tiny_llama)
    rest = tinker.RestClient()
    path = tc.save_state("with-meta", ttl_seconds=3600, user_metadata={"step": "1", "data": "gsm8k"}).result().path
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[path].user_metadata == {"step": "1", "data": "gsm8k"}
    expires = listed[path].expires_at.timestamp()
    assert time.time() + 3500 < expires <= time.time() + 3600
    assert listed[path].size_bytes > 0
    sampler = tc.save_weights_for_sampler("s-meta", user_metadata={"kind": "eval"}).result().path
    assert {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[
        sampler].user_metadata == {"kind": "eval"}
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    assert {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[path].expires_at is None
    with pytest.raises(tinker.BadRequestError):
        rest.set_checkpoint_ttl_from_tinker_path(path, 0).result()
    with pytest.raises(tinker.RequestFailedError, match="ttl_seconds"):
        tc.save_state("bad-ttl", ttl_seconds=-5).result()
    # a short TTL: the server deletes the checkpoint (files too) and loading it is a 404
    rest.set_checkpoint_ttl_from_tinker_path(path, 1).result()
    native = httpx.Client(base_url=tinker_env.url, timeout=60)
    pkg = next(p for p in native.get("/v1/checkpoints", params={"run_id": tc.model_id}).json()
               if p["name"] == "with-meta")
    files = Path(tinker_env.app.state.whitney.store.get_package(pkg["id"]).path)
    assert files.is_dir()
    deadline = time.monotonic() + 20
    while files.exists():  # polled: the reaper deletes them on its next pass past the expiry
        assert time.monotonic() < deadline, "the expired checkpoint's files were never deleted"
        time.sleep(0.05)
    assert path not in {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        service_client.create_training_client_from_state(path).result()


def test_publish_is_readable_by_other_keys_never_writable(keyed, tiny_llama):
    tc = trained(keyed["service"][K1], tiny_llama)
    path = tc.save_weights_for_sampler("published").result().path
    state = tc.save_state("published-state").result().path
    owner, other = keyed["rest"][K1], keyed["rest"][K2]
    with pytest.raises(tinker.NotFoundError):
        keyed["service"][K2].create_sampling_client(model_path=path).result()
    owner.publish_checkpoint_from_tinker_path(path).result()
    owner.publish_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.BadRequestError, match="already public"):
        owner.publish_checkpoint_from_tinker_path(path).result()
    assert {c.tinker_path: c.public for c in owner.list_checkpoints(tc.model_id).result().checkpoints}[path]
    # K2 reads: samples from it, loads it into a run of its own
    sampler = keyed["service"][K2].create_sampling_client(model_path=path).result()
    out = sampler.sample(types.ModelInput.from_ints([1, 17, 250]), 1,
                         types.SamplingParams(max_tokens=3, temperature=0.0)).result()
    assert len(out.sequences[0].tokens) == 3
    loaded = keyed["service"][K2].create_training_client_from_state(state).result()
    assert loss(loaded) == pytest.approx(loss(tc), rel=1e-5)  # K1's trained weights
    # ... and never writes
    for write in (lambda: other.delete_checkpoint_from_tinker_path(path),
                  lambda: other.set_checkpoint_ttl_from_tinker_path(path, 3600),
                  lambda: other.unpublish_checkpoint_from_tinker_path(path)):
        with pytest.raises(tinker.NotFoundError):
            write().result()
    owner.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        keyed["service"][K2].create_sampling_client(model_path=path).result()


def test_copy_weights_within_a_key_and_across_keys(keyed, tiny_llama):
    tc = trained(keyed["service"][K1], tiny_llama)
    state = tc.save_state("to-copy").result().path
    rest = keyed["rest"][K1]
    copied = rest.copy_weights(state, "archive", ttl_seconds=7200).result()
    assert copied != state and copied.endswith("/weights/to-copy")
    run = rest.get_training_run_by_tinker_path(copied).result()
    assert run.user_metadata == {"copied_from": state}
    listed = {c.tinker_path: c for c in rest.list_checkpoints(run.training_run_id).result().checkpoints}
    assert listed[copied].expires_at is not None
    also = keyed["service"][K1].copy_weights(state).result()  # into the client's project
    assert also not in (state, copied)
    # across keys: K2 holds K1 too and presents it as the weights access token
    with pytest.raises(tinker.NotFoundError):
        keyed["rest"][K2].copy_weights(state, "theirs").result()
    theirs = keyed["rest"][K2].copy_weights(state, "theirs", weights_access_token=K1).result()
    resumed = keyed["service"][K2].create_training_client_from_state(theirs).result()
    assert loss(resumed) == pytest.approx(loss(tc), rel=1e-5)  # the same weights
    direct = keyed["service"][K2].create_training_client_from_state(state, weights_access_token=K1).result()
    assert loss(direct) == pytest.approx(loss(tc), rel=1e-5)


def test_save_weights_external_downloads_a_peft_adapter(tinker_env, service_client, tiny_llama, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tc = trained(service_client, tiny_llama)
    path = tc.save_weights_external("hf-export").result().path
    assert path == f"tinker://{tc.model_id}/external_weights/hf-export"
    rest = tinker.RestClient()
    assert {c.tinker_path: c.checkpoint_type for c in rest.list_checkpoints(tc.model_id).result().checkpoints}[
        path] == "external"
    found = rest.get_external_weights_urls(path).result()
    assert found.expires > datetime.now(timezone.utc)
    with httpx.Client(timeout=60) as plain:  # signed URLs: no key
        for name, url in found.urls.items():
            (tmp_path / name).write_bytes(plain.get(url).raise_for_status().content)
    with pytest.raises(tinker.RequestFailedError, match="age"):
        tc.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result()
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.tensor([[1, 17, 250, 4000, 12]])
    with torch.no_grad():
        before = base(ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, str(tmp_path))(ids).logits[0].log_softmax(-1)
    assert not torch.allclose(before[0].log_softmax(-1), tuned)
    # the adapter's log-probs are the server's own
    sampler = tc.save_weights_and_get_sampling_client("same-weights").result()
    server = sampler.compute_logprobs(types.ModelInput.from_ints(ids[0].tolist())).result()
    expected = tuned[:-1].gather(-1, ids[0, 1:, None])[:, 0]
    assert server[1:] == pytest.approx(expected.tolist(), rel=1e-4, abs=1e-5)


def test_sessions_tags_project_display_name_and_search(keyed, tiny_llama, monkeypatch):
    earlier = keyed["service"][K1].holder.get_session_id()  # another session of K1's, made before
    monkeypatch.setenv("TINKER_TAGS", "nightly,sft")
    client = tinker.ServiceClient(base_url=keyed["server"].url, api_key=K1, display_name="Nightly SFT",
                                  project_id="proj-b", user_metadata={"team": "rl"})
    trained(client, tiny_llama)
    session_id = client.holder.get_session_id()
    rest = keyed["rest"][K1]
    assert rest.get_session(session_id).result().display_name == "Nightly SFT"
    native = keyed["server"].http(K1)
    row = native.get(f"/v1/sessions/{session_id}").json()
    assert (sorted(row["tags"]), row["project_id"]) == (["nightly", "sft"], "proj-b")
    assert [s["id"] for s in native.get("/v1/sessions", params={"tag": "nightly"}).json()] == [session_id]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        page = rest.search_sessions(types.SessionSearchRequest(display_name="sft nightly")).result()
        assert [s.session_id for s in page.sessions] == [session_id]
        hit = page.sessions[0]
        assert (hit.project_id, hit.user_metadata, hit.status.type) == ("proj-b", {"team": "rl"}, "active")
        rest.assign_session_project(session_id, "proj-c").result()
        assert [s.session_id for s in rest.search_sessions(types.SessionSearchRequest(
            project_ids=["proj-c"])).result().sessions] == [session_id]
        assert rest.search_sessions(types.SessionSearchRequest(project_ids=["proj-b"])).result().sessions == []
        one = rest.search_sessions(types.SessionSearchRequest(limit=1)).result()
        second = rest.search_sessions(types.SessionSearchRequest(limit=1, cursor=one.next_cursor)).result()
        newest = [s["id"] for s in native.get("/v1/sessions").json()][::-1][:2]  # native: oldest first
        assert earlier in [s["id"] for s in native.get("/v1/sessions").json()]
        assert one.next_cursor is not None and [s.session_id for s in one.sessions + second.sessions] == newest
        assert newest[0] == session_id  # newest first, a page at a time
        assert keyed["rest"][K2].search_sessions(types.SessionSearchRequest(
            project_ids=["proj-c"])).result().sessions == []  # another key's sessions are not its to see
    # A cursor is the server's own next_cursor: a time in another form is still read (UTC when it has no zone),
    # one that is no time is a 400 naming the field, never a 500.
    search = {"owner": {"type": "own"}, "limit": 1}
    cursor = {"last_created_at": one.next_cursor.last_created_at.replace(tzinfo=None).isoformat(),
              "last_session_id": one.next_cursor.last_session_id}
    got = native.post("/api/v1/sessions/search", json={**search, "cursor": cursor})
    assert got.status_code == 200 and [s["session_id"] for s in got.json()["sessions"]] == newest[1:2], got.text
    bad = native.post("/api/v1/sessions/search", json={**search, "cursor": {**cursor, "last_created_at": "soon"}})
    assert bad.status_code == 400 and "cursor.last_created_at must be an ISO 8601 time" in bad.text, bad.text
    client.close("success").result()


def test_whoami_trace_and_audit_log(keyed, tiny_llama):
    me, them = keyed["rest"][K1].whoami().result(), keyed["rest"][K2].whoami().result()
    assert me.user_urn.startswith("tml:user:whitney-key:") and me.user_urn != them.user_urn
    assert me.org_urn == "tml:organization:whitney" and me.email is None
    tc = trained(keyed["service"][K1], tiny_llama)
    tc.save_state("audited").result()
    session_id = keyed["service"][K1].holder.get_session_id()
    url = keyed["rest"][K1].export_session_trace(session_id).result()
    trace = httpx.get(url, timeout=60).raise_for_status().json()  # signed: no key
    kinds = [e["name"] for e in trace["traceEvents"] if e["tid"] == tc.model_id]
    assert kinds == ["forward_backward", "optim_step", "save_state"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        entries = keyed["rest"][K1].get_audit_log().result().entries
        saves = keyed["rest"][K1].get_audit_log(event_type="checkpoints").result().entries
        assert keyed["rest"][K1].get_audit_log(event_type="projects").result().entries == []
        them_entries = keyed["rest"][K2].get_audit_log().result().entries
    mine = [e for e in entries if e.model_id == tc.model_id]
    assert [e.event for e in mine] == ["operation_forward_backward", "operation_optim_step", "operation_save_state"]
    assert all(e.event_details["status"] == "succeeded" for e in mine)
    assert "operation_save_state" in {e.event for e in saves} and "operation_optim_step" not in {e.event for e in saves}
    assert tc.model_id not in {e.model_id for e in them_entries}


def test_deprecated_async_twins(keyed, tiny_llama, tmp_path):
    """Each deprecated *_async method reaches the same endpoint as its twin."""
    client, rest = keyed["service"][K1], keyed["rest"][K1]
    tc = trained(client, tiny_llama)
    state = tc.save_state("async-state").result().path
    session_id = client.holder.get_session_id()

    async def go():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            external = await (await tc.save_weights_external_async("async-ext"))
            urls = await rest.get_external_weights_urls_async(external.path)
            await rest.set_checkpoint_ttl_from_tinker_path_async(state, 7200)
            await rest.publish_checkpoint_from_tinker_path_async(state)
            await rest.unpublish_checkpoint_from_tinker_path_async(state)
            copied = await rest.copy_weights_async(state, "async-proj")
            await rest.assign_session_project_async(session_id, "async-proj")
            trace = await rest.export_session_trace_async(session_id)
            audit = await rest.get_audit_log_async()
            return urls, copied, trace, audit

    urls, copied, trace, audit = asyncio.run(go())
    assert "adapter_config.json" in urls.urls and copied.endswith("/weights/async-state")
    assert trace.startswith(keyed["server"].url) and audit.entries
    listed = {c.tinker_path: c for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    assert listed[state].expires_at is not None and not listed[state].public
