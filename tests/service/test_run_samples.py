"""Samples a loop logs for its run: the store functions on a real SQLite file and a real PostgreSQL server (the
bounds, the replace-by-step rule, an older database getting the table), and POST/GET /v1/runs/{run_id}/samples
on a real server with API keys (the thin client's methods too)."""

from __future__ import annotations

import json
import math
import time

import pytest
from sqlalchemy import inspect, text

from tests.service.test_run_metrics import new_run, optim_step
from whitney import Client
from whitney.client import WhitneyAPIError
from whitney.errors import InvalidInput, NotFound, TooLarge
from whitney.service.store import run_samples
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind, RunStatus
from whitney.service.store.run_samples import SampleLimits

KEY_A, KEY_B = "tml-samples-key-a", "tml-samples-key-b"


def samples(n: int, tag: str = "s", **extra) -> list[dict]:
    return [{"prompt": f"{tag} prompt {i}", "completion": f"{tag} completion {i}", **extra} for i in range(n)]


# ---- the store ---------------------------------------------------------------------------------------

def test_log_replace_list_and_default_step(store):
    run_id = new_run(store)
    logged = run_samples.log_samples(store, run_id, "me", [{"prompt": "2+2=", "completion": "4", "reward": 1,
                                                             "metadata": {"group": 3, "ok": True}}])
    assert logged == {"run_id": run_id, "step": 0, "count": 1}
    optim_step(store, run_id, 0, 1)
    optim_step(store, run_id, 1, 2)
    assert run_samples.log_samples(store, run_id, "me", samples(3, "a"))["step"] == 2  # the optimizer's step
    run_samples.log_samples(store, run_id, "me", samples(2, "b"), step=7)
    # Logged again at step 7: the step's samples are replaced as a whole (a resend stores them once).
    run_samples.log_samples(store, run_id, "me", samples(2, "c", reward=0.5), step=7)
    rows = run_samples.list_samples(store, run_id, "me")
    assert [(r["step"], r["index"]) for r in rows] == [(7, 0), (7, 1), (2, 0), (2, 1), (2, 2), (0, 0)]
    assert [r["completion"] for r in rows[:2]] == ["c completion 0", "c completion 1"]
    assert rows[0]["reward"] == 0.5 and rows[0]["metadata"] is None and rows[0]["logged_at"] <= time.time()
    assert rows[-1] == {**rows[-1], "prompt": "2+2=", "completion": "4", "reward": 1.0,
                        "metadata": {"group": 3, "ok": True}}
    assert run_samples.list_samples(store, run_id, "me", step=2) == rows[2:5]
    assert run_samples.list_samples(store, run_id, "me", before_step=7) == rows[2:]
    assert run_samples.list_samples(store, run_id, "me", limit=2) == rows[:2]
    assert run_samples.sample_steps(store, run_id) == [(7, 2), (2, 3), (0, 1)]
    # Text is kept as it was sent: newlines, long lines, any script.
    text_ = "línea 1\n\tзадача: 两个\n" + "x" * 5000
    run_samples.log_samples(store, run_id, "me", [{"prompt": text_, "completion": text_}], step=9)
    assert run_samples.list_samples(store, run_id, "me", step=9)[0]["completion"] == text_


def test_owner_only_and_ended_runs(store):
    run_id = new_run(store, "me")
    with pytest.raises(NotFound):
        run_samples.log_samples(store, run_id, "someone-else", samples(1))
    with pytest.raises(NotFound):
        run_samples.list_samples(store, run_id, "someone-else")
    with pytest.raises(NotFound):
        run_samples.log_samples(store, "run-nope", "me", samples(1))
    assert store.set_run_status(run_id, RunStatus.FINISHED)  # a final evaluation's samples after finish
    run_samples.log_samples(store, run_id, "me", samples(1), step=3)
    assert len(run_samples.list_samples(store, run_id, "me")) == 1


@pytest.mark.parametrize("batch, error, field, rule", [
    ([], InvalidInput, "samples", "at least one sample"),
    (samples(65), TooLarge, "samples", "65 samples; the limit is 64 per request"),
    ([{"prompt": "p", "completion": "c"}, {"prompt": "p", "completion": "x" * 32_769}], TooLarge,
     "samples.1.completion", "32769 characters; the limit is 32768"),
    ([{"prompt": "p" * 40_000, "completion": "c"}], TooLarge, "samples.0.prompt", "the limit is 32768"),
    (samples(1, reward=math.nan), InvalidInput, "samples.0.reward", "finite number"),
    (samples(1, reward=math.inf), InvalidInput, "samples.0.reward", "finite number"),
    (samples(1, reward=True), InvalidInput, "samples.0.reward", "finite number"),
    (samples(1, metadata={"k": "v" * 4100}), TooLarge, "samples.0.metadata", "the limit is 4096"),
])
def test_bad_samples_store_nothing(store, batch, error, field, rule):
    run_id = new_run(store)
    with pytest.raises(error, match=rule) as e:
        run_samples.log_samples(store, run_id, "me", batch)
    assert e.value.field == field
    assert run_samples.list_samples(store, run_id, "me") == []


def test_run_and_key_limits(store):
    """Per run and per key (count and bytes), counted after the step's old samples are deleted, all runs of the
    key together; a refused request leaves what was stored."""
    limits = SampleLimits(max_samples_per_run=5, max_samples_per_key=8, max_bytes_per_key=400)
    run_a, run_b = new_run(store), new_run(store)
    one = [{"prompt": "ab", "completion": "é", "metadata": {"k": 1}}]  # 2 + 2 + 7 bytes
    run_samples.log_samples(store, run_a, "me", one * 4, 0, limits)
    run_samples.log_samples(store, run_a, "me", one * 5, 0, limits)  # replaces step 0's 4: 5 in the run
    with pytest.raises(TooLarge, match="holds 5 samples, 1 more would pass the limit of 5 per run"):
        run_samples.log_samples(store, run_a, "me", one, 1, limits)
    run_samples.log_samples(store, run_b, "me", one * 3, 0, limits)  # 8 for the key
    with pytest.raises(TooLarge, match="this key holds 8 samples, 1 more would pass the limit of 8 per key") as e:
        run_samples.log_samples(store, run_b, "me", one, 1, limits)
    assert e.value.field == "samples"
    run_samples.log_samples(store, new_run(store, "other"), "other", one * 5, 0, limits)  # another key's own room
    assert len(run_samples.list_samples(store, run_a, "me")) == 5
    # Bytes: 8 samples of 11 bytes held; one of 320 bytes more passes 400. Replacing run_b's step 0 (33 bytes)
    # with it does not: the step's old samples are deleted first.
    big = [{"prompt": "p" * 160, "completion": "c" * 160}]
    with pytest.raises(TooLarge, match="holds 88 bytes of samples, 320 more would pass the limit of 400"):
        run_samples.log_samples(store, run_b, "me", big, 2, SampleLimits(max_bytes_per_key=400))
    run_samples.log_samples(store, run_b, "me", big, 0, SampleLimits(max_bytes_per_key=400))
    assert [s["completion"] for s in run_samples.list_samples(store, run_b, "me")] == ["c" * 160]


def test_older_database_gets_the_table_and_the_operations_column(db_url):
    """A database made by a version without run_samples and operations.config: opening the store adds both."""
    with Store(db_url).engine.begin() as conn:
        conn.execute(text("DROP TABLE run_samples"))
        conn.execute(text("ALTER TABLE operations DROP COLUMN config"))
    store = Store(db_url)
    found = inspect(store.engine)
    assert found.has_table("run_samples") and "config" in {c["name"] for c in found.get_columns("operations")}
    run_id = new_run(store)
    run_samples.log_samples(store, run_id, "me", samples(2), step=1)
    assert len(run_samples.list_samples(store, run_id, "me")) == 2
    op, _ = store.submit_operation("me", run_id, 0, OperationKind.OPTIM_STEP, "d0",
                                   config={"adam_params": {"learning_rate": 1e-3}})
    assert store.get_operation(op.id).config == {"adam_params": {"learning_rate": 1e-3}}


# ---- the routes, over HTTP ---------------------------------------------------------------------------

@pytest.fixture
def server(make_server):
    return make_server(api_keys=[KEY_A, KEY_B])


def test_routes_log_and_list(server):
    with Client(server.url, api_key=KEY_A) as client:
        run = client.create_session().create_run(rank=4)
        batch = [{"prompt": "Q: 1+1?", "completion": " 2", "reward": 1.0, "metadata": {"group": 0}},
                 {"prompt": "Q: 1+1?", "completion": " 3", "reward": 0.0}]
        assert run.log_samples(batch) == {"run_id": run.id, "step": 0, "count": 2}
        run.log_samples(batch[:1], step=5)
        got = run.samples()
        assert [(s["step"], s["index"], s["completion"], s["reward"], s["metadata"]) for s in got] == [
            (5, 0, " 2", 1.0, {"group": 0}), (0, 0, " 2", 1.0, {"group": 0}), (0, 1, " 3", 0.0, None)]
        assert run.samples(step=0) == got[1:]
        assert run.samples(limit=1) == got[:1]
        run.finish()
        run.log_samples(batch, step=5)  # a finished run still takes them; step 5 replaced
        assert len(run.samples(step=5)) == 2


def test_routes_refuse_other_keys_and_bad_input(server):
    with Client(server.url, api_key=KEY_A) as client:
        run = client.create_session().create_run(rank=4)
    url = f"/v1/runs/{run.id}/samples"
    with server.http(KEY_B) as other:
        for r in (other.post(url, json={"samples": samples(1)}), other.get(url)):
            assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    with server.http() as anonymous:
        assert anonymous.get(url).status_code == 401
    with server.http(KEY_A) as http:
        # Over the request's bounds: a 413 naming the field and the rule, decided on the raw list (100,000 empty
        # objects are refused for their count, before any is validated).
        r = http.post(url, content=json.dumps({"samples": [{}] * 100_000}),
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json() == {
            "code": "too_large", "field": "samples",
            "message": "samples holds 100000 samples; the limit is 64 per request (and per step)"}
        r = http.post(url, json={"samples": [{"prompt": "p", "completion": "c" * 40_000}]})
        assert r.status_code == 413 and r.json()["field"] == "samples.0.completion", r.text
        assert "40000 characters; the limit is 32768" in r.json()["message"]
        r = http.post(url, json={"samples": samples(1, metadata={"k": "v" * 5000})})
        assert r.status_code == 413 and r.json()["field"] == "samples.0.metadata"
        r = http.post(url, content='{"samples": [{"prompt": "p", "completion": "c", "reward": NaN}]}',
                      headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["field"] == "samples.0.reward", r.text
        r = http.post(url, json={"samples": []})
        assert r.status_code == 400 and "at least one" in r.json()["message"]
        # Not the schema: a 422 naming the field (an unknown field, a number for text, a negative step).
        for body, field in (({"samples": [{"prompt": "p", "completion": "c", "score": 1}]}, "samples.0.score"),
                            ({"samples": [{"prompt": "p", "completion": 3}]}, "samples.0.completion"),
                            ({"samples": [{"prompt": "p"}]}, "samples.0.completion"),
                            ({"samples": samples(1), "step": -1}, "step"),
                            ({"samples": samples(1), "extra": 1}, "extra")):
            r = http.post(url, json=body)
            assert r.status_code == 422 and r.json()["code"] == "invalid_request", (body, r.text)
            assert field in r.json()["field"], (body, r.json())
        assert http.get(url).json() == {"run_id": run.id, "samples": []}  # nothing refused was stored
        assert http.get(url, params={"limit": 0}).status_code == 422
        assert http.post("/v1/runs/run-nope/samples", json={"samples": samples(1)}).status_code == 404


def test_client_raises_the_servers_error(server):
    with Client(server.url, api_key=KEY_A) as client:
        run = client.create_session().create_run(rank=4)
        with pytest.raises(WhitneyAPIError) as e:
            run.log_samples([{"prompt": "p", "completion": "c", "reward": float("inf")}])
        assert e.value.status == 400 and e.value.field == "samples.0.reward"
