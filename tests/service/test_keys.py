"""API keys and per-key quotas against a real server: each limit answers 429 + Retry-After and admits again
once usage drops; a key's own limits override the server's; `whitney keys` works on a running server's
database; only digests are stored; every route but /healthz needs a key; finished runs give memory back."""

from __future__ import annotations

import gc
import os
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.service.test_flow import ADAM, expect, sft_batch, succeeded
from whitney import cli
from whitney.service.api.native import schemas
from whitney.service.http import refusals
from whitney.service.store import keys as keyring, quotas
from whitney.service.store.key_limits import KeyLimits

LORA = {"rank": 4, "alpha": 8.0, "seed": 0}
KEY = "k-config"


def keys_cli(capsys, server, *args: str) -> str:
    """`whitney keys ...` in this process, against the server's own SQLite file; its stdout."""
    capsys.readouterr()
    assert cli.main(["keys", *args, "--data-dir", str(server.config.data_dir)]) == 0
    return capsys.readouterr().out


def create_key(capsys, server, *args: str) -> str:
    return keys_cli(capsys, server, "create", *args).strip()


def quota_error(response, field: str, limit: int) -> dict:
    """A 429 with a Retry-After of whole seconds, and the error body naming the limit."""
    assert response.status_code == 429, response.text
    retry_after = int(response.headers["Retry-After"])
    assert 1 <= retry_after <= 60
    body = response.json()
    assert body["code"] == "quota_exceeded" and body["field"] == field and body["limit"] == limit, body
    assert str(limit) in body["message"]
    assert set(body) <= set(schemas.Error.model_fields), body  # the body the OpenAPI document shows
    return body


def session(http) -> str:
    return expect(http.post("/v1/sessions", json={}), 201)["id"]


def new_run(http, sid: str, **lora) -> str:
    return expect(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {**LORA, **lora}}), 201)["id"]


def fb(http, run: str, seq: int, examples=None):
    body = {"seq_id": seq, "data": sft_batch(examples) if examples else sft_batch()}
    return http.post(f"/v1/runs/{run}/forward_backward", json=body)


# ---- each quota --------------------------------------------------------------------------------------------

def test_live_sessions(make_server):
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_sessions=2))
    with server.http(KEY) as http:
        first, _ = session(http), session(http)
        body = quota_error(http.post("/v1/sessions", json={}), "max_sessions", 2)
        assert body["usage"] == 2 and "holds 2" in body["message"]
        assert len(expect(http.get("/v1/sessions"), 200)) == 2  # the refused request created nothing
        # The Tinker sub-app answers the same way (the SDK retries a 429 after Retry-After).
        r = http.post("/api/v1/create_session", json={"tags": []}, headers={"X-API-Key": KEY})
        quota_error(r, "max_sessions", 2)
        expect(http.post(f"/v1/sessions/{first}/close"), 200)  # a closed session no longer counts
        session(http)


def test_live_runs_and_their_memory(make_server):
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_runs=2))
    with server.http(KEY) as http:
        sid = session(http)
        a, b = new_run(http, sid), new_run(http, sid)
        quota_error(http.post(f"/v1/sessions/{sid}/runs", json={"lora": LORA}), "max_runs", 2)
        assert len(expect(http.get(f"/v1/sessions/{sid}/runs"), 200)) == 2
        assert len(server.engine.runs) == 2  # nor an adapter
        expect(http.post(f"/v1/runs/{a}/finish"), 200)
        c = new_run(http, sid)
        expect(http.post(f"/v1/runs/{b}/cancel"), 200)
        # b counts while cancelling (it holds its adapter until the worker drops it), then no longer.
        eventually(lambda: expect(http.get("/v1/quota"), 200)["usage"]["runs"] == 1)
        new_run(http, sid)
        expect(http.post(f"/v1/runs/{c}/cancel"), 200)
        # A cancelling run holds its adapter until the worker has dropped it, then no longer counts.
        eventually(lambda: expect(http.get("/v1/quota"), 200)["usage"]["runs"] == 1)
        # The byte count: 16 bytes (weight, two AdamW moments, gradient) per LoRA number the engine made.
        held = expect(http.get("/v1/quota"), 200)
        assert len(server.engine.runs) == 1
        adapter = next(iter(server.engine.runs.values())).adapter
        assert held["usage"]["adapter_bytes"] == 16 * sum(p.numel() for p in adapter.parameters())
        assert held["usage"]["runs"] == 1 and held["limits"]["max_runs"] == 2


def test_adapter_memory(make_server, capsys):
    server = make_server(require_keys=True)
    probe = create_key(capsys, server)
    with server.http(probe) as http:
        new_run(http, session(http))
        cost = expect(http.get("/v1/quota"), 200)["usage"]["adapter_bytes"]  # one rank-4 run
    key = create_key(capsys, server, "--max-adapter-bytes", str(int(2.5 * cost)))
    with server.http(key) as http:
        sid = session(http)
        first, _ = new_run(http, sid), new_run(http, sid)
        body = quota_error(http.post(f"/v1/sessions/{sid}/runs", json={"lora": LORA}), "max_adapter_bytes",
                           int(2.5 * cost))
        assert body["usage"] == 2 * cost and str(cost) in body["message"]
        # A smaller adapter fits in what is left; a larger one does not.
        quota_error(http.post(f"/v1/sessions/{sid}/runs", json={"lora": {**LORA, "rank": 8}}),
                    "max_adapter_bytes", int(2.5 * cost))
        new_run(http, sid, rank=2)
        expect(http.post(f"/v1/runs/{first}/finish"), 200)
        new_run(http, sid)


def test_queued_operations(make_server):
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_queued_operations=2))
    with server.http(KEY) as http:
        run = new_run(http, session(http))
        # seq 1 and 2 wait for seq 0: both stay queued.
        ops = [expect(fb(http, run, seq), 202)["id"] for seq in (1, 2)]
        body = quota_error(fb(http, run, 3), "max_queued_operations", 2)
        assert body["usage"] == 2 and body["field"] == "max_queued_operations"
        assert expect(fb(http, run, 1), 202)["id"] == ops[0]  # a retry adds nothing: never refused
        # seq 0 is what the queued ones wait for: admitted over the limit, or the run could never move.
        ops.insert(0, expect(fb(http, run, 0), 202)["id"])
        for op in ops:
            succeeded(http, op)
        assert [o["seq_id"] for o in expect(http.get(f"/v1/runs/{run}/operations"), 200)] == [0, 1, 2]
        succeeded(http, expect(fb(http, run, 3), 202)["id"])  # the queue has drained


def test_tokens_per_minute(make_server, monkeypatch):
    skipped = [0.0]  # the quotas' clock runs this far ahead of the real one: the test moves it past the window
    monkeypatch.setattr(quotas, "time", SimpleNamespace(time=lambda: time.time() + skipped[0]))
    tokens = sum(len(d["input"]["token_ids"]) for d in sft_batch())
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_tokens_per_minute=2 * tokens + 1))
    with server.http(KEY) as http:
        run = new_run(http, session(http))
        first = [expect(fb(http, run, seq), 202)["id"] for seq in (0, 1)]
        refused = fb(http, run, 2)
        body = quota_error(refused, "max_tokens_per_minute", 2 * tokens + 1)
        assert body["usage"] == 2 * tokens
        assert 1 <= int(refused.headers["Retry-After"]) <= quotas.WINDOW
        whole = [([1] * 20, [2] * 20)]  # 39 tokens: more than the limit by itself, so never admitted
        r = fb(http, run, 2, whole)
        assert r.status_code == 400 and r.json()["field"] == "max_tokens_per_minute", r.text
        skipped[0] += int(refused.headers["Retry-After"])  # the wait it asked for, on the quotas' clock
        for op in [*first, expect(fb(http, run, 2), 202)["id"]]:
            succeeded(http, op)


def test_validation_counts_against_the_keys_tokens_per_minute(make_server):
    """Issue 31, item 3: a forward's validation (a custom loss's graph runs then) is the key's work: its tokens
    count when validation starts, passed or refused, and the operation it becomes does not count them twice."""
    tokens = sum(len(d["input"]["token_ids"]) for d in sft_batch())
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_tokens_per_minute=10 * tokens))
    with server.http(KEY) as http:
        run = new_run(http, session(http))
        bad = sft_batch()
        weights = bad[0]["loss_inputs"]["weights"]
        weights["values"], weights["shape"] = weights["values"][:1], [1]  # fewer weights than target tokens: the
        # engine's validation refuses it
        r = http.post(f"/v1/runs/{run}/forward_backward", json={"seq_id": 0, "data": bad})
        assert r.status_code == 400, r.text
        assert expect(http.get("/v1/quota"), 200)["usage"]["tokens_per_minute"] == tokens, "validation went uncounted"
        op = expect(fb(http, run, 0), 202)["id"]
        assert expect(http.get("/v1/quota"), 200)["usage"]["tokens_per_minute"] == 2 * tokens
        assert expect(fb(http, run, 0), 202)["id"] == op  # a retry: answered from the store, not counted again
        assert expect(http.get("/v1/quota"), 200)["usage"]["tokens_per_minute"] == 2 * tokens
        succeeded(http, op)


def test_a_key_has_at_most_two_custom_loss_requests_validated_at_once(make_server, monkeypatch):
    """A custom loss's validation (its graph dry-run) runs on a request thread: one key may hold two of them at once,
    a third of its own is a 429 (concurrent_validations), never a third thread; another key's request is validated
    meanwhile, and so is a built-in loss's request of the same key (linear work: a client may pipeline those)."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.engine.test_custom_loss import definition, weighted_nll

    server = make_server(api_keys=[KEY, "k-other"])
    backend = server.app.state.whitney.scheduler.backend
    entered, release, real = threading.Semaphore(0), threading.Event(), backend.validate

    def held(request, backward):  # a custom loss's validation lasts until the test lets it end
        if request.loss_fn == "custom":
            entered.release()
            release.wait(30)
        return real(request, backward)

    def custom_fb(http, run: str, seq: int):
        loss_id = mine if http is not other else theirs_loss
        body = {"seq_id": seq, "data": sft_batch(), "loss_function": "custom", "loss_config": {"loss_id": loss_id}}
        return http.post(f"/v1/runs/{run}/forward_backward", json=body)

    monkeypatch.setattr(backend, "validate", held)
    with server.http(KEY) as http, server.http("k-other") as other:
        mine = expect(http.post("/v1/custom_losses", json=definition(weighted_nll, {"logprobs": 1, "weights": 1})), 201)["id"]
        theirs_loss = expect(other.post("/v1/custom_losses", json=definition(weighted_nll, {"logprobs": 1, "weights": 1})), 201)["id"]
        run, plain, theirs = new_run(http, session(http)), new_run(http, session(http)), new_run(other, session(other))
        clients = [server.http(KEY) for _ in range(2)]
        with ThreadPoolExecutor(3) as pool:
            first = [pool.submit(custom_fb, c, run, seq) for c, seq in zip(clients, (0, 1))]
            assert entered.acquire(timeout=30) and entered.acquire(timeout=30), "two validations began"
            try:
                quota_error(custom_fb(http, run, 2), "concurrent_validations", quotas.VALIDATIONS_PER_KEY)
                for seq in range(3):  # built-in losses of the same key are not held back
                    expect(fb(http, plain, seq), 202)
                another = pool.submit(custom_fb, other, theirs, 0)
                assert entered.acquire(timeout=30), "another key's validation waits for nothing"
            finally:
                release.set()
            for f in [*first, another]:
                succeeded(http if f is not another else other, expect(f.result(), 202)["id"])
        for c in clients:
            c.close()
        expect(custom_fb(http, run, 2), 202)  # the slots are free again


def test_a_keys_own_limits_override_the_servers(make_server, capsys):
    server = make_server(key_limits=KeyLimits(max_runs=1))
    more = create_key(capsys, server, "--max-runs", "3", "--name", "more")
    unlimited = create_key(capsys, server, "--max-runs", "0")
    plain = create_key(capsys, server)
    for key, allowed in ((more, 3), (unlimited, 5), (plain, 1)):
        with server.http(key) as http:
            sid = session(http)
            for _ in range(allowed):
                new_run(http, sid)
            if key != unlimited:
                quota_error(http.post(f"/v1/sessions/{sid}/runs", json={"lora": LORA}), "max_runs", allowed)
    listing = keys_cli(capsys, server, "list")
    assert "more" in listing and "max_runs=3" in listing and "max_runs=0" in listing
    assert not any(k in listing for k in (more, unlimited, plain))


# ---- whitney keys on a running server ------------------------------------------------------------------------

def test_keys_made_and_revoked_while_the_server_runs(make_server, capsys, monkeypatch):
    monkeypatch.setattr(keyring, "CACHE_SECONDS", 0.05)  # the server's key cache: changes show within 50 ms
    server = make_server()
    with server.http() as anonymous:
        session(anonymous)  # no key anywhere yet: the server is open
        key = create_key(capsys, server, "--name", "ci")
        assert key.startswith("tml-wk-") and len(key) > 40
        with server.http(key) as http:
            session(http)  # the new key works at once
            eventually(lambda: anonymous.post("/v1/sessions", json={}).status_code == 401)  # a key exists: keys on
            assert len(expect(http.get("/v1/sessions"), 200)) == 1  # its own, not the anonymous one
            (row,) = [r for r in keys_json(capsys, server) if r["name"] == "ci"]
            assert row["revoked_at"] is None and "digest" not in row and key not in str(row)
            assert keys_cli(capsys, server, "revoke", row["id"]).startswith(f"revoked {row['id']}")
            eventually(lambda: http.get("/v1/sessions").status_code == 401)
            body = http.get("/v1/sessions").json()
            assert body["code"] == "unauthorized" and body["field"] == "authorization"
            # Revoking the last key leaves keys on: nothing opens the server by accident.
            assert anonymous.post("/v1/sessions", json={}).status_code == 401
        assert keys_json(capsys, server)[0]["revoked_at"] is not None


def test_keys_are_stored_as_digests(make_server, capsys):
    server = make_server()
    keys = [create_key(capsys, server) for _ in range(3)]
    with server.http(keys[0]) as http:
        session(http)
    files = list(Path(server.config.data_dir).glob("whitney.db*"))  # the database, its WAL and shared memory
    assert files
    stored = b"".join(f.read_bytes() for f in files)
    for key in keys:
        assert key.encode() not in stored and key[len("tml-wk-"):].encode() not in stored
    import hashlib

    assert hashlib.sha256(keys[0].encode()).hexdigest().encode() in stored


def test_a_keys_owner_is_its_digest_as_before(make_server, capsys):
    """Rows carry sha256(key)[:32], as they did before keys were stored: an --api-key keeps its sessions."""
    import hashlib

    server = make_server(api_keys=[KEY])
    with server.http(KEY) as http:
        sid = session(http)
    store = server.app.state.whitney.store
    assert store.get_session(sid, hashlib.sha256(KEY.encode()).hexdigest()[:32]).id == sid
    made = create_key(capsys, server)
    with server.http(made) as http:
        assert http.get(f"/v1/sessions/{sid}").status_code == 404  # another key, another owner
        assert store.list_sessions(hashlib.sha256(made.encode()).hexdigest()[:32]) == []


def test_a_requests_key_is_checked_once(make_server, monkeypatch):
    """KeyGate checks the key before routing and hands its owner to the route: no second check per request."""
    server = make_server(api_keys=[KEY])
    keys, calls = server.app.state.whitney.keys, []
    check = keys.owner_of_digest  # what owner() and the gate's cached_owner() ask
    monkeypatch.setattr(keys, "owner_of_digest",
                        lambda digest, lookup=True: calls.append(digest) or check(digest, lookup))
    with server.http(KEY) as http:
        sid = session(http)
        calls.clear()
        assert expect(http.get(f"/v1/sessions/{sid}"), 200)["id"] == sid
        assert calls == [keyring.digest_of(KEY)]
        assert http.get(f"/v1/sessions/{sid}", headers={"Authorization": "Bearer k-wrong"}).status_code == 401


def keys_json(capsys, server) -> list[dict]:
    import json

    return json.loads(keys_cli(capsys, server, "list", "--json"))


def eventually(condition, timeout: float = 5.0) -> None:
    """Poll until the condition holds (a cancelled run's adapter dropped, the key cache renewed)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not within the key cache's lifetime"
        time.sleep(0.02)


# ---- keys cover everything ---------------------------------------------------------------------------------

OPEN_WITHOUT_KEYS_BEFORE = [
    ("GET", "/v1/training/capabilities"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/redoc"),
    ("GET", "/api/v1/healthz"), ("GET", "/api/v1/get_server_capabilities"), ("POST", "/api/v1/client/config"),
    ("POST", "/api/v1/client/dynamic_config"), ("POST", "/api/v1/telemetry"), ("GET", "/api/v1/openapi.json"),
    ("GET", "/api/v1/docs"), ("GET", "/v1/quota"), ("GET", "/no/such/path"), ("OPTIONS", "/v1/sessions"),
]


def test_every_route_but_healthz_needs_a_key(make_server, tiny_llama):
    server = make_server(api_keys=[KEY])
    with server.http() as anonymous, server.http("k-wrong") as wrong, server.http(KEY) as http:
        for method, path in OPEN_WITHOUT_KEYS_BEFORE:
            for client in (anonymous, wrong):
                r = client.request(method, path, json={} if method == "POST" else None)
                assert r.status_code == 401, (method, path, r.status_code)
                assert r.json()["code"] == "unauthorized", (method, path)
            assert http.request(method, path, json={} if method == "POST" else None,
                                headers={"X-API-Key": KEY}).status_code != 401, (method, path)
        assert expect(anonymous.get("/healthz"), 200) == {"status": "ok"}


def test_no_route_shows_a_server_path(make_server, tiny_llama):
    """A model served from a directory is named by the directory's name; the full path is still accepted."""
    server = make_server(api_keys=[KEY])
    name = Path(tiny_llama).name
    with server.http(KEY) as http:
        caps = http.get("/v1/training/capabilities")
        tinker_caps = http.get("/api/v1/get_server_capabilities", headers={"X-API-Key": KEY})
        for r in (caps, tinker_caps):
            assert r.status_code == 200 and str(Path(tiny_llama).parent) not in r.text
        assert [m["name"] for m in caps.json()["models"]] == [name]
        assert [m["model_name"] for m in tinker_caps.json()["supported_models"]] == [name]
        sid = session(http)
        for base_model in (name, tiny_llama):  # the name shown, and the path as the server was given it
            r = http.post(f"/v1/sessions/{sid}/runs", json={"base_model": base_model, "lora": LORA})
            assert expect(r, 201)["base_model"] == base_model
        by_name = expect(http.post("/v1/samples", json={"prompt": [1, 2], "max_tokens": 2, "base_model": name}), 202)
        succeeded(http, by_name["id"])
        bad = http.post(f"/v1/sessions/{sid}/runs", json={"base_model": "nope", "lora": LORA})
        assert bad.status_code == 400 and str(Path(tiny_llama).parent) not in bad.text


def test_the_tinker_sdk_with_a_key_retries_a_429(make_server, capsys, monkeypatch, tiny_llama):
    import tinker
    from tinker import types

    monkeypatch.setattr(quotas, "WINDOW", 2.0)  # the SDK sleeps the Retry-After it is given (at most 2 s)
    refusals = []  # the quota's answers: the 429s the SDK must have retried
    spend = quotas.Quotas._spend

    def counted(self, owner, tokens, limit):
        try:
            return spend(self, owner, tokens, limit)
        except quotas.QuotaExceeded as e:
            refusals.append(e.retry_after)
            raise

    monkeypatch.setattr(quotas.Quotas, "_spend", counted)
    server = make_server(require_keys=True)
    key = create_key(capsys, server, "--max-tokens-per-minute", "12")
    client = tinker.ServiceClient(base_url=server.url, api_key=key)
    try:
        caps = tinker.RestClient(base_url=server.url, api_key=key).get_server_capabilities().result()
        assert [m.model_name for m in caps.supported_models] == [Path(tiny_llama).name]
        tc = client.create_lora_training_client(base_model=Path(tiny_llama).name, rank=4, seed=0).result()
        datum = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
                            loss_fn_inputs={"target_tokens": [2, 3, 4, 5, 6], "weights": [1.0] * 5})
        # 5 tokens each: the third is refused (429, Retry-After <= 2 s) and sent again by the SDK itself.
        futures = [tc.forward_backward([datum], "cross_entropy") for _ in range(3)]
        results = [f.result() for f in futures]
        assert all(r.metrics["loss:sum"] > 0 for r in results)
        assert refusals and all(1 <= wait <= 2 for wait in refusals), refusals  # it was refused, then admitted
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    finally:
        client.close("success").result()
    with server.http() as anonymous:
        assert anonymous.get("/api/v1/healthz").status_code == 401


# ---- finished runs give their memory back --------------------------------------------------------------------

def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc")
def test_finished_runs_give_their_memory_back(make_server):
    """20 rank-32 runs, each trained one step (weights, AdamW moments, gradients: ~25 MB each with the tiny
    model's 49k-row unembedding), then finished: RSS returns close to where it was before them."""
    server = make_server(api_keys=[KEY])

    def train_runs(http, count: int) -> list[str]:
        sid = session(http)
        runs = [new_run(http, sid, rank=32) for _ in range(count)]
        ops = [expect(fb(http, run, 0), 202)["id"] for run in runs]
        ops += [expect(http.post(f"/v1/runs/{run}/optim_step", json={"seq_id": 1, "adam_params": ADAM}), 202)["id"]
                for run in runs]
        ops += [expect(fb(http, run, 2), 202)["id"] for run in runs]  # a gradient held at the end too
        for op in ops:
            succeeded(http, op)
        return runs

    with server.http(KEY) as http:
        for run in train_runs(http, 2):  # warm-up: the allocator's and torch's own first-use costs
            expect(http.post(f"/v1/runs/{run}/finish"), 200)
        gc.collect()
        before = rss()
        runs = train_runs(http, 20)
        during = rss()
        for run in runs:
            expect(http.post(f"/v1/runs/{run}/finish"), 200)
        gc.collect()
        after = rss()
    grown = during - before
    assert grown > 20 * 10 * 2**20, f"the runs should hold > 200 MB, held {grown / 2**20:.0f} MB"
    assert after - before < 0.15 * grown, \
        f"RSS before {before / 2**20:.0f} MB, with the runs {during / 2**20:.0f} MB, after {after / 2**20:.0f} MB"


def test_a_key_whose_requests_are_refused_waits_for_its_budget(make_server, monkeypatch):
    """max_refusals_per_minute: a key's refused requests (4xx for what they hold) spend its budget, one more per
    MiB of body; once spent, its requests wait for the budget to refill, and one that would wait more than
    MAX_WAIT is answered 429 at once, its body unread. Another key's requests are not held up."""
    skipped = [0.0]  # the budget's clock runs this far ahead of the real one
    monkeypatch.setattr(refusals, "time", SimpleNamespace(monotonic=lambda: time.monotonic() + skipped[0]))
    server = make_server(api_keys=[KEY, "k-other"], key_limits=KeyLimits(max_refusals_per_minute=3))
    deep = {"user_metadata": {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}}
    with server.http(KEY) as http, server.http("k-other") as other:
        for _ in range(3):
            assert http.post("/v1/sessions", json=deep).status_code == 400
        refused = http.post("/v1/sessions", json={})  # valid, but the key's budget is spent: 20 s away
        assert refused.status_code == 429 and refused.headers["Retry-After"] == "20", refused.text
        body = refused.json()
        assert body["code"] == "too_many_refusals" and body["field"] == "max_refusals_per_minute" \
            and body["limit"] == 3, body
        assert set(body) <= set(schemas.Error.model_fields), body
        # Answered before its body is read: a body the server would refuse as too large is not looked at.
        huge = http.post("/v1/sessions", content=b"{" * (server.config.limits.max_request_bytes + 1),
                         headers={"content-type": "application/json"})
        assert huge.status_code == 429, huge.text
        assert other.post("/v1/sessions", json=deep).status_code == 400  # the other key: its own budget
        assert other.post("/v1/sessions", json={}).status_code == 201
        skipped[0] += 20  # the wait it asked for
        session(http)  # admitted again; a valid request spends nothing
        session(http)
        # A refused body of 2 MiB spends 1 + 2 of the 1 refilled: the budget is owed 2, 3 refills (60 s) away.
        assert http.post("/v1/sessions", content=b"[" + b" " * (2 << 20) + b"]",
                         headers={"content-type": "application/json"}).status_code in (400, 422)
        assert http.post("/v1/sessions", json={}).headers.get("Retry-After") == "60"


def test_a_request_within_max_wait_waits_and_runs(make_server):
    """Once the budget is spent, a request that the budget lets in within MAX_WAIT waits for it, then runs."""
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_refusals_per_minute=60))  # one back per second
    with server.http(KEY) as http:
        for _ in range(60):
            assert http.post("/v1/sessions", json={"user_metadata": 1}).status_code in (400, 422)
        start = time.monotonic()
        session(http)
        assert time.monotonic() - start >= 0.5  # it waited for the budget (about 1 s less the time the loop took)


def test_the_quota_shows_the_refusals_spent(make_server):
    """GET /v1/quota: usage.refusals_per_minute counts the key's refused requests against its budget."""
    server = make_server(api_keys=[KEY], key_limits=KeyLimits(max_refusals_per_minute=50))
    with server.http(KEY) as http:
        assert expect(http.get("/v1/quota"), 200)["usage"]["refusals_per_minute"] == 0
        for _ in range(3):
            assert http.post("/v1/sessions", json={"user_metadata": 1}).status_code in (400, 422)
        quota = expect(http.get("/v1/quota"), 200)
        assert quota["limits"]["max_refusals_per_minute"] == 50 and quota["usage"]["refusals_per_minute"] == 3


def test_the_refusal_buckets_stay_bounded():
    """At most max_keys buckets in memory: when full, a new key's bucket replaces those that owe nothing (a full
    bucket is what a key starts with anyway); one that owes is kept."""
    from whitney.service.store.refusals import RefusalBudget

    budget = RefusalBudget(lambda owner: 10, max_keys=2)
    budget.bucket("full", 10, 0.0)
    budget.bucket("owing", 10, 0.0).tokens -= 5
    budget.bucket("new", 10, 1.0)
    assert set(budget._buckets) == {"owing", "new"}
    assert budget.spent("owing", 1.0) == 5 and budget.spent("full", 1.0) == 0
