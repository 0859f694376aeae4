"""Checkpoint lifecycle and session labels: the store functions (on SQLite and PostgreSQL) and the native API
over a real server (whitney.service.store.packages, projects; routes/checkpoints.py, sessions.py).

TTLs end in deletion (files and row) by the server's reaper, never under a load in progress; user_metadata,
publishing (readable by other keys, never writable), copies between runs and keys (hard links), signed
download URLs of a PEFT export that loads with peft; sessions' tags, project and display name, filtered;
the migration of a database written before these columns existed.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import httpx
import pytest
from sqlalchemy import inspect, text

from tests.service.test_flow import ADAM, expect, fb_body, succeeded, until
from whitney.errors import Conflict, NotFound
from whitney.service.scheduling import reaping
from whitney.service.store import packages, projects
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind, OperationStatus


def new_package(store: Store, tmp_path: Path, owner: str = "me", name: str = "ckpt") -> dict:
    """A run of a new session with one saved-state package whose directory holds one file."""
    session = store.create_session(owner)
    run = store.create_run(session.id, owner, "tiny", {"rank": 4}, None, False, None)
    path = tmp_path / f"pkg-{time.monotonic_ns()}"
    path.mkdir()
    (path / "adapter.safetensors").write_bytes(b"weights")
    return store.register_package(run.id, owner, "state", name, str(path), "tiny", True)


# ---- the store ----------------------------------------------------------------------------------------


def test_an_expired_package_reads_404_and_the_reaper_deletes_files_and_row(store, tmp_path):
    package = new_package(store, tmp_path)
    packages.settle(store, package.id, "me", ttl_seconds=1, user_metadata={"step": "7"})
    kept = store.get_package(package.id, "me")
    assert kept.user_metadata == {"step": "7"} and kept.expires_at > time.time()
    assert packages.reap(store) == []  # not yet expired
    assert packages.reap(store, now=time.time() + 2) == [package.id]
    with pytest.raises(NotFound):
        store.get_package(package.id, "me")
    assert not Path(package.path).exists()
    with store.tx() as db:
        assert db.execute(text("SELECT count(*) FROM model_packages")).scalar() == 0


def test_the_reaper_waits_for_readers_and_a_reader_never_starts_on_an_expired_package(store, tmp_path):
    package = new_package(store, tmp_path)
    assert packages.acquire(store, package.path)  # a load in progress
    packages.settle(store, package.id, "me", ttl_seconds=1)
    later = time.time() + 2
    assert packages.reap(store, now=later) == [], "deleted under a load in progress"
    assert Path(package.path).exists()
    with pytest.raises(Conflict):
        packages.remove(store, package.id, "me")  # a delete waits for the load too
    packages.release(store, package.path)
    assert packages.reap(store, now=later) == [package.id]
    assert not packages.acquire(store, package.path)  # gone: no new reader
    other = new_package(store, tmp_path, name="other")
    packages.settle(store, other.id, "me", ttl_seconds=1)
    with store.tx() as db:  # past its expiry, not reaped yet: a reader is refused all the same
        db.execute(text("UPDATE model_packages SET expires_at = 1 WHERE id = :i"), {"i": other.id})
    assert not packages.acquire(store, other.path)


def test_readers_and_the_reaper_racing_never_both_win(store, tmp_path):
    """Readers and the reaper hammer one package as it expires: either it was deleted and nobody got to read
    it, or somebody reads it and it stays (readers here never release)."""
    for attempt in range(5):
        package = new_package(store, tmp_path, name=f"race{attempt}")
        expires = time.time() + 0.3
        with store.tx() as db:
            db.execute(text("UPDATE model_packages SET expires_at = :e WHERE id = :i"),
                       {"e": expires, "i": package.id})
        acquired, reaped, start = [], [], threading.Barrier(5)

        def reader():
            start.wait()
            while time.time() < expires + 0.2:
                if packages.acquire(store, package.path):
                    acquired.append(time.time())
                    return

        def reaper():  # on a loaded machine it may get the CPU late: once nobody read it, it must reap it
            start.wait()
            while not reaped and (time.time() < expires + 0.4 or (not acquired and time.time() < expires + 30)):
                reaped.extend(packages.reap(store))

        threads = [threading.Thread(target=reader) for _ in range(4)] + [threading.Thread(target=reaper)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert bool(reaped) != bool(acquired), (reaped, acquired)
        assert Path(package.path).exists() == bool(acquired)


def test_public_packages_are_readable_by_others_and_writable_only_by_their_owner(store, tmp_path):
    package = new_package(store, tmp_path)
    with pytest.raises(NotFound):
        store.get_package(package.id, "you")
    packages.publish(store, package.id, "me", True)
    with pytest.raises(Conflict):
        packages.publish(store, package.id, "me", True)
    assert store.get_package(package.id, "you").public is True
    assert [p.id for p in packages.public_packages(store)] == [package.id]
    for write in (lambda: packages.remove(store, package.id, "you"),
                  lambda: packages.settle(store, package.id, "you", ttl_seconds=5),
                  lambda: packages.publish(store, package.id, "you", False)):
        with pytest.raises(NotFound):
            write()
    assert store.list_packages("you") == []  # listed by its owner only
    packages.publish(store, package.id, "me", False)
    with pytest.raises(NotFound):
        store.get_package(package.id, "you")
    assert packages.readable(store, package.id, "you", also="me").id == package.id  # holds both keys


def test_a_copy_is_hard_linked_and_outlives_its_source(store, tmp_path):
    source = new_package(store, tmp_path)
    packages.settle(store, source.id, "me", user_metadata={"note": "x"}, ttl_seconds=100)
    session = store.create_session("you")
    target = store.create_run(session.id, "you", "tiny", {"rank": 4}, None, False, None)
    copy = packages.copy(store, store.get_package(source.id, "me"), "you", target.id, ttl_seconds=None)
    assert copy.owner == "you" and copy.kind == "state" and copy.name == "ckpt"
    assert copy.user_metadata == {"note": "x"} and copy.expires_at is None  # expiry is not inherited
    a, b = Path(source.path) / "adapter.safetensors", Path(copy.path) / "adapter.safetensors"
    assert os.stat(a).st_ino == os.stat(b).st_ino  # no bytes duplicated
    packages.remove(store, source.id, "me")
    assert b.read_bytes() == b"weights" and store.get_package(copy.id, "you").id == copy.id
    with pytest.raises(NotFound):  # only into the caller's own runs
        packages.copy(store, store.get_package(copy.id, "you"), "me", target.id)


def test_save_settings_apply_as_the_operation_succeeds_and_readers_release_as_it_ends(store, tmp_path):
    package = new_package(store, tmp_path)
    op, _ = store.submit_operation("me", package.run_id, 0, OperationKind.SAVE_STATE, "d")
    packages.settle_at_end(store, op.id, 60, {"k": "v"})
    assert store.set_operation(op.id, OperationStatus.SUCCEEDED, result={"package": {"id": package.id}})
    done = store.get_operation(op.id).result["package"]
    assert done["user_metadata"] == {"k": "v"} and done["expires_at"] > time.time() + 50
    assert store.get_package(package.id, "me").user_metadata == {"k": "v"}
    read, _ = packages.reading(store, package.path, lambda: store.submit_operation(
        "me", package.run_id, 1, OperationKind.LOAD_STATE, "e"))
    assert store.get_package(package.id, "me").readers == 1
    store.cancel_queued(package.run_id, "test")  # ended without running: released all the same
    assert store.get_package(package.id, "me").readers == 0
    with pytest.raises(packages.InvalidInput):
        packages.settle_at_end(store, "op-x", 0, None)


def test_session_labels_are_stored_and_filter(store):
    a = store.create_session("me")
    projects.label(store, a.id, "me", tags=["nightly", "gpu"], project_id="p1", display_name="Nightly SFT run")
    b = store.create_session("me")
    projects.label(store, b.id, "me", tags=["nightly"], project_id="p2", display_name="eval")
    store.create_session("you")
    ids = lambda **f: [s.id for s in projects.find_sessions(store, "me", **f)]  # noqa: E731
    assert ids() == [b.id, a.id]  # newest first
    assert ids(tags=["nightly"]) == [b.id, a.id] and ids(tags=["nightly", "gpu"]) == [a.id]
    assert ids(project_ids=["p2"]) == [b.id] and ids(display_name="sft NIGHTLY") == [a.id]
    assert ids(display_name="eval", session_id=a.id) == [b.id, a.id]  # either matches
    assert ids(statuses=["closed"]) == []
    with pytest.raises(packages.InvalidInput):
        projects.label(store, a.id, "me", tags=[""])
    with pytest.raises(NotFound):
        projects.label(store, a.id, "you", project_id="p")


def test_a_database_of_the_previous_schema_is_migrated(db_url, tmp_path):
    """The previous version's tables (today's without the columns this version added), holding rows: opening
    the store adds the columns with their defaults and keeps every row."""
    Store(db_url).engine.dispose()
    old = Store(db_url)
    with old.engine.begin() as conn:
        conn.execute(text("DROP INDEX ix_sessions_project_id"))
        conn.execute(text("DROP INDEX ix_operations_owner_status"))
        for table, column in (("sessions", "tags"), ("sessions", "project_id"), ("sessions", "display_name"),
                              ("model_packages", "expires_at"), ("model_packages", "readers"),
                              ("model_packages", "public"), ("model_packages", "user_metadata")):
            conn.execute(text(f"ALTER TABLE {table} DROP COLUMN {column}"))
        conn.execute(text("INSERT INTO sessions (id, owner, status, created_at, last_heartbeat, user_metadata) "
                          "VALUES ('ses-old', 'me', 'active', 1, 1, '{}')"))
        conn.execute(text("INSERT INTO runs (id, session_id, owner, base_model, lora, status, created_at, "
                          "resume_with_optimizer, user_metadata) VALUES ('run-old', 'ses-old', 'me', 'tiny', "
                          "'{\"rank\": 4}', 'active', 1, false, '{}')"))
        conn.execute(text("INSERT INTO model_packages (id, run_id, owner, kind, name, version, path, base_model, "
                          "has_optimizer, created_at, deleted) VALUES ('pkg-old', 'run-old', 'me', 'state', 'a', 1, "
                          f"'{tmp_path / 'nowhere'}', 'tiny', false, 1, false)"))
    old.engine.dispose()
    store = Store(db_url)
    package = store.get_package("pkg-old", "me")
    assert (package.readers, package.public, package.expires_at, package.user_metadata) == (0, False, None, None)
    assert packages.acquire(store, package.path) and packages.reap(store, now=time.time() + 10**9) == []
    assert projects.label(store, "ses-old", "me", tags=["t"], project_id="p").project_id == "p"
    assert [s.id for s in projects.find_sessions(store, "me", project_ids=["p"])] == ["ses-old"]
    assert "ix_operations_owner_status" in {i["name"] for i in inspect(store.engine).get_indexes("operations")}
    Store(db_url)  # opening it again changes nothing


# ---- the native API -------------------------------------------------------------------------------------


def trained_run(http: httpx.Client, **session) -> tuple[str, str]:
    """A session (with labels) and a run with one forward_backward and optim_step done."""
    sid = expect(http.post("/v1/sessions", json=session), 201)["id"]
    rid = expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {"rank": 4, "seed": 3}}), 201)["id"]
    succeeded(http, expect(http.post(f"/v1/runs/{rid}/forward_backward", json=fb_body(0)), 202)["id"])
    succeeded(http, expect(http.post(f"/v1/runs/{rid}/optim_step", json={"seq_id": 1, "adam_params": ADAM}),
                           202)["id"])
    return sid, rid


def save_state(http: httpx.Client, rid: str, seq_id: int, name: str = "ckpt") -> dict:
    op = expect(http.post(f"/v1/runs/{rid}/save_state", json={"seq_id": seq_id, "name": name}), 202)
    return succeeded(http, op["id"])["package"]


def test_ttl_expiry_waits_for_a_queued_load_then_deletes(make_server, monkeypatch):
    passes: list[tuple[float, list[str]]] = []  # the reaper's passes: when each began, what it deleted

    def reap(store, now=None):
        began = time.time()
        passes.append((began, packages.reap(store, now)))
        return passes[-1][1]

    monkeypatch.setattr(reaping, "reap", reap)
    server = make_server(expiry_interval=0.05)  # a pass at each idle turn of the worker loop, not every 5 s
    http = server.http()
    _, rid = trained_run(http)
    ckpt = save_state(http, rid, 2)
    meta = expect(http.patch(f"/v1/checkpoints/{ckpt['id']}", json={"user_metadata": {"step": 2}}), 200)
    assert meta["user_metadata"] == {"step": 2} and meta["expires_at"] is None
    # A load of it queued behind a gap (seq 3 is missing): a load in progress, as far as the reaper knows.
    load = expect(http.post(f"/v1/runs/{rid}/load_state", json={"seq_id": 4, "checkpoint_id": ckpt["id"]}), 202)
    ttl = expect(http.patch(f"/v1/checkpoints/{ckpt['id']}", json={"ttl_seconds": 1}), 200)
    assert ttl["expires_at"] <= time.time() + 1 and ttl["user_metadata"] == {"step": 2}
    until(lambda: http.get(f"/v1/checkpoints/{ckpt['id']}").status_code == 404, 10, "expired checkpoint reads 404")
    until(lambda: any(began > ttl["expires_at"] for began, _ in passes), 15, "a reaper pass past the expiry")
    assert not any(ckpt["id"] in deleted for _, deleted in passes), "deleted under a queued load"
    with server.app.state.whitney.store.tx() as db:
        row = db.execute(text("SELECT path, readers FROM model_packages WHERE id = :i"), {"i": ckpt["id"]}).first()
    assert row is not None and row.readers == 1 and Path(row.path).is_dir(), "deleted under a queued load"
    succeeded(http, expect(http.post(f"/v1/runs/{rid}/forward", json=fb_body(3)), 202)["id"])
    assert succeeded(http, load["id"])["checkpoint_id"] == ckpt["id"]  # the load ran on the files
    def gone() -> bool:  # the reaper deletes the files, then the row (a second transaction)
        with server.app.state.whitney.store.tx() as db:
            rows = db.execute(text("SELECT count(*) FROM model_packages WHERE id = :i"), {"i": ckpt["id"]}).scalar()
        return rows == 0 and not Path(row.path).exists()
    until(gone, 15, "the reaper deleting the files and the row once the load ended")
    late = expect(http.post(f"/v1/runs/{rid}/load_state", json={"seq_id": 5, "checkpoint_id": ckpt["id"]}), 404)
    assert late["code"] == "not_found"
    expect(http.patch(f"/v1/checkpoints/{save_state(http, rid, 5)['id']}", json={"ttl_seconds": 0}), 422)


def test_published_checkpoints_are_readable_by_other_keys_never_writable(make_server, tmp_path):
    server = make_server(api_keys=["k1", "k2"])
    k1, k2 = server.http("k1"), server.http("k2")
    _, rid = trained_run(k1)
    ckpt = save_state(k1, rid, 2)
    expect(k2.get(f"/v1/checkpoints/{ckpt['id']}"), 404)
    assert expect(k1.post(f"/v1/checkpoints/{ckpt['id']}/publish"), 200)["public"] is True
    expect(k1.post(f"/v1/checkpoints/{ckpt['id']}/publish"), 409)
    assert expect(k2.get(f"/v1/checkpoints/{ckpt['id']}"), 200)["public"] is True
    assert [p["id"] for p in expect(k2.get("/v1/checkpoints", params={"public": True}), 200)] == [ckpt["id"]]
    assert expect(k2.get("/v1/checkpoints"), 200) == []
    # read: sample, resume a run of k2's own, download
    op = expect(k2.post("/v1/samples", json={"checkpoint_id": ckpt["id"], "prompt": [1, 2], "max_tokens": 3,
                                             "temperature": 0.0}), 202)
    assert len(succeeded(k2, op["id"])["sequences"][0]["tokens"]) == 3
    sid2 = expect(k2.post("/v1/sessions", json={}), 201)["id"]
    resumed = expect(k2.post(f"/v1/sessions/{sid2}/runs", json={"resume_from": {"checkpoint_id": ckpt["id"]}}), 201)
    assert resumed["resume_from"] == ckpt["id"]
    assert k2.get(f"/v1/checkpoints/{ckpt['id']}/archive").content[:100]
    # never write
    expect(k2.delete(f"/v1/checkpoints/{ckpt['id']}"), 404)
    expect(k2.patch(f"/v1/checkpoints/{ckpt['id']}", json={"ttl_seconds": 5}), 404)
    expect(k2.delete(f"/v1/checkpoints/{ckpt['id']}/publish"), 404)
    expect(k1.delete(f"/v1/checkpoints/{ckpt['id']}/publish"), 200)
    expect(k2.get(f"/v1/checkpoints/{ckpt['id']}"), 404)
    expect(k2.post("/v1/samples", json={"checkpoint_id": ckpt["id"], "prompt": [1, 2]}), 404)


def test_copies_between_runs_and_keys(make_server):
    server = make_server(api_keys=["k1", "k2"])
    k1, k2 = server.http("k1"), server.http("k2")
    _, rid = trained_run(k1)
    ckpt = save_state(k1, rid, 2)
    sid2 = expect(k1.post("/v1/sessions", json={}), 201)["id"]
    other = expect(k1.post(f"/v1/sessions/{sid2}/runs", json={"lora": {"rank": 4}}), 201)["id"]
    mine = expect(k1.post(f"/v1/checkpoints/{ckpt['id']}/copy", json={"run_id": other, "name": "moved"}), 201)
    assert (mine["run_id"], mine["name"], mine["kind"]) == (other, "moved", "state")
    k2_sid = expect(k2.post("/v1/sessions", json={}), 201)["id"]
    k2_run = expect(k2.post(f"/v1/sessions/{k2_sid}/runs", json={"lora": {"rank": 4}}), 201)["id"]
    expect(k2.post(f"/v1/checkpoints/{ckpt['id']}/copy", json={"run_id": k2_run}), 404)  # not k2's to read
    expect(k2.post(f"/v1/checkpoints/{ckpt['id']}/copy", json={"run_id": k2_run}, headers={"X-Source-Key": "bad"}),
           401)
    expect(k2.post(f"/v1/checkpoints/{ckpt['id']}/copy", json={"run_id": rid}, headers={"X-Source-Key": "k1"}),
           404)  # into k1's run: not k2's
    theirs = expect(k2.post(f"/v1/checkpoints/{ckpt['id']}/copy", json={"run_id": k2_run, "ttl_seconds": 3600},
                            headers={"X-Source-Key": "k1"}), 201)
    assert theirs["expires_at"] > time.time() + 3000
    expect(k1.delete(f"/v1/checkpoints/{ckpt['id']}"), 200)
    # k2 loads its copy into its run: the source's files are gone, the copy's are not
    load = expect(k2.post(f"/v1/runs/{k2_run}/load_state", json={"seq_id": 0, "checkpoint_id": theirs["id"]}), 202)
    assert succeeded(k2, load["id"])["checkpoint_id"] == theirs["id"]


def test_signed_file_urls_of_a_peft_export_load_with_peft(make_server, tiny_llama, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    server = make_server(api_keys=["k1"])
    k1 = server.http("k1")
    _, rid = trained_run(k1)
    lora = succeeded(k1, expect(k1.post(f"/v1/runs/{rid}/export_lora", json={"seq_id": 2, "name": "hf"}),
                                202)["id"])["package"]
    found = expect(k1.get(f"/v1/checkpoints/{lora['id']}/files"), 200)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(found["urls"])
    out = tmp_path / "adapter"
    out.mkdir()
    with httpx.Client(timeout=60) as plain:  # no key: the signature is the permission
        for name, url in found["urls"].items():
            (out / name).parent.mkdir(parents=True, exist_ok=True)
            (out / name).write_bytes(expect_bytes(plain.get(url)))
        bad = found["urls"]["adapter_config.json"].replace("/adapter_config.json", "/adapter_model.safetensors")
        assert plain.get(bad).status_code == 404  # a signature is for one file
        assert plain.get(server.url + "/v1/checkpoints").status_code == 401
    base = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
    ids = torch.tensor([[1, 17, 250, 4000]])
    with torch.no_grad():
        before = base(ids).logits.clone()
        tuned = PeftModel.from_pretrained(base, str(out))(ids).logits
    assert not torch.allclose(before, tuned), "the exported adapter changes nothing: were its weights lost?"
    expect(k1.get(f"/v1/checkpoints/{lora['id']}/files"), 200)


def expect_bytes(response: httpx.Response) -> bytes:
    assert response.status_code == 200, response.text
    return response.content


def test_sessions_labels_filters_trace_audit_and_whoami(make_server):
    server = make_server(require_keys=True)
    from whitney.service.store.keys import digest_of, new_key

    key = new_key()
    row = server.app.state.whitney.store.create_key(digest_of(key), "alice", {})
    http = server.http(key)
    sid, rid = trained_run(http, tags=["nightly", "sft"], project_id="proj", display_name="Nightly SFT")
    other = expect(http.post("/v1/sessions", json={"tags": ["eval"]}), 201)
    assert expect(http.get(f"/v1/sessions/{sid}"), 200)["tags"] == ["nightly", "sft"]
    ids = lambda **q: [s["id"] for s in expect(http.get("/v1/sessions", params=q), 200)]  # noqa: E731
    assert ids() == [sid, other["id"]]
    assert ids(tag="nightly") == [sid] and ids(tag=["nightly", "eval"]) == [] and ids(tag="eval") == [other["id"]]
    assert ids(project_id="proj") == [sid] and ids(display_name="sft") == [sid] and ids(status="closed") == []
    patched = expect(http.patch(f"/v1/sessions/{other['id']}", json={"project_id": "proj", "display_name": "ev"}),
                     200)
    assert (patched["project_id"], patched["display_name"], patched["tags"]) == ("proj", "ev", ["eval"])
    assert ids(project_id="proj") == [sid, other["id"]]
    expect(http.post("/v1/sessions", json={"tags": [""]}), 422)
    expect(http.post("/v1/sessions", json={"display_name": "x" * 257}), 422)
    ops = expect(http.get(f"/v1/sessions/{sid}/operations"), 200)
    assert [o["kind"] for o in ops] == ["forward_backward", "optim_step"]
    assert all(o["status"] == "succeeded" and o["created_at"] <= o["started_at"] <= o["finished_at"] for o in ops)
    trace = expect(http.get(f"/v1/sessions/{sid}/trace"), 200)
    assert [e["name"] for e in trace["traceEvents"]] == ["forward_backward", "optim_step"]
    assert all(e["tid"] == rid and e["dur"] >= 0 for e in trace["traceEvents"])
    audit = expect(http.get("/v1/audit", params={"since": ops[0]["created_at"]}), 200)
    assert [o["operation_id"] for o in audit] == [o["operation_id"] for o in ops]
    assert expect(http.get("/v1/whoami"), 200) == {"key_id": row.id, "name": "alice",
                                                    "owner": digest_of(key)[:32]}


# ---- nested free JSON (issue 31, item 8) ---------------------------------------------------------------


def nested(depth: int) -> dict:
    """{"a": {"a": ... 1}}: `depth` objects inside one another."""
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def refused_as_too_deep(response: httpx.Response, field: str) -> None:
    body = expect(response, 400)
    assert body["code"] == "invalid_input" and body["field"] == field and "32" in body["message"], body


def test_free_json_nested_too_deep_is_refused_at_the_edge_and_nothing_is_stored(make_server, tmp_path):
    server = make_server(api_keys=["k1"])
    http = server.http("k1")
    deep = nested(300)  # 600 bytes: small, but no response could show it (pydantic's serialiser stops at 255)
    refused_as_too_deep(http.post("/v1/sessions", json={"user_metadata": deep}), "user_metadata")
    assert expect(http.get("/v1/sessions"), 200) == []
    tinker = http.post("/api/v1/create_session", json={"tags": [], "user_metadata": deep}, headers={"X-API-Key": "k1"})
    refused_as_too_deep(tinker, "user_metadata")
    sid = expect(http.post("/v1/sessions", json={"user_metadata": nested(32)}), 201)["id"]  # the limit itself
    refused_as_too_deep(http.post(f"/v1/sessions/{sid}/runs", json={"user_metadata": deep}), "user_metadata")
    rid = expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {"rank": 4}}), 201)["id"]
    refused_as_too_deep(http.post(f"/v1/runs/{rid}/forward", json={**fb_body(0), "loss_config": deep}),
                        "loss_config")
    sample = {"prompt": "p", "completion": "c", "metadata": deep}
    refused_as_too_deep(http.post(f"/v1/runs/{rid}/samples", json={"samples": [sample]}), "samples.0.metadata")
    store = server.app.state.whitney.store
    package = new_package(store, tmp_path, owner=store.get_run(rid).owner)
    refused_as_too_deep(http.patch(f"/v1/checkpoints/{package.id}", json={"user_metadata": deep}), "user_metadata")
    assert expect(http.get(f"/v1/checkpoints/{package.id}"), 200)["user_metadata"] is None
    assert len(expect(http.get(f"/v1/sessions/{sid}/runs"), 200)) == 1


def test_a_stored_row_nested_too_deep_breaks_no_read_of_another_key(make_server, tmp_path):
    """Rows written before the edge checked nesting (or straight into the database): every read still answers,
    the value cut at 32 levels; one json.loads cannot even parse reads as a marker."""
    import json

    server = make_server(api_keys=["k1", "k2"])
    k1, k2 = server.http("k1"), server.http("k2")
    store = server.app.state.whitney.store
    sid = expect(k1.post("/v1/sessions", json={}), 201)["id"]
    package = new_package(store, tmp_path, owner=_owner(store, sid))
    expect(k1.post(f"/v1/checkpoints/{package.id}/publish"), 200)
    with store.tx() as db:  # as the old server stored them
        db.execute(text("UPDATE model_packages SET user_metadata = :m WHERE id = :i"),
                   {"m": json.dumps(nested(300)), "i": package.id})
        db.execute(text("UPDATE sessions SET user_metadata = :m WHERE id = :i"),
                   {"m": "[" * 5_000 + "]" * 5_000, "i": sid})
    listed = expect(k2.get("/v1/checkpoints", params={"public": True}), 200)
    from whitney.service.store import json_values

    assert [p["id"] for p in listed] == [package.id]
    shown, depth = listed[0]["user_metadata"], 1
    while isinstance(shown, dict):
        shown, depth = shown["a"], depth + 1
    assert shown == json_values.TOO_DEEP and depth == json_values.MAX_DEPTH + 1
    assert expect(k1.get(f"/v1/checkpoints/{package.id}"), 200)["id"] == package.id
    sessions = expect(k1.get("/v1/sessions"), 200)
    assert sessions[0]["user_metadata"] == json_values.UNREADABLE
    expect(k1.get(f"/v1/sessions/{sid}"), 200)


def _owner(store: Store, session_id: str) -> str:
    with store.tx() as db:
        return db.execute(text("SELECT owner FROM sessions WHERE id = :i"), {"i": session_id}).scalar_one()
