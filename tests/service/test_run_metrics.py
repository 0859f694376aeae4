"""Metrics a loop logs for its run: the store functions on a real SQLite file and a real PostgreSQL server, and
POST/GET /v1/runs/{run_id}/metrics on a real server with API keys (the thin client's methods too)."""

from __future__ import annotations

import math
import threading

import pytest
from sqlalchemy import text

from tests.console.trainer import EXAMPLES
from whitney import Client
from whitney.client import WhitneyAPIError
from whitney.datums import sft_datum
from whitney.errors import InvalidInput, NotFound, TooLarge
from whitney.service.store import run_metrics
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind, OperationStatus, RunStatus
from whitney.service.store.run_metrics import MetricLimits

KEY_A, KEY_B = "tml-metrics-key-a", "tml-metrics-key-b"


def new_run(store: Store, owner: str = "me") -> str:
    session = store.create_session(owner)
    return store.create_run(session.id, owner, "tiny", {"rank": 4}, None, False, None).id


def optim_step(store: Store, run_id: str, seq_id: int, step: int) -> None:
    op, _ = store.submit_operation("me", run_id, seq_id, OperationKind.OPTIM_STEP, f"d{seq_id}")
    store.set_operation(op.id, OperationStatus.RUNNING)
    store.set_operation(op.id, OperationStatus.SUCCEEDED, result={"metrics": {"step": float(step),
                                                                                 "grad_norm": 1.0}})


# ---- the store ---------------------------------------------------------------------------------------

def test_log_list_replace_and_default_step(store):
    run_id = new_run(store)
    assert run_metrics.log_metrics(store, run_id, "me", {"reward/mean": 0.25, "reward/max": 1})["step"] == 0
    optim_step(store, run_id, 0, 1)
    optim_step(store, run_id, 1, 2)
    logged = run_metrics.log_metrics(store, run_id, "me", {"reward/mean": 0.5})
    assert logged == {"run_id": run_id, "step": 2, "metrics": {"reward/mean": 0.5}}
    run_metrics.log_metrics(store, run_id, "me", {"reward/mean": 0.75, "eval/acc": 0.1}, step=7)
    # The same name at the same step again: the value is replaced, no second point.
    run_metrics.log_metrics(store, run_id, "me", {"reward/mean": 0.8}, step=7)
    series = run_metrics.metric_series(store, run_id, "me")
    assert series == {"eval/acc": {"steps": [7], "values": [0.1]},
                      "reward/max": {"steps": [0], "values": [1.0]},
                      "reward/mean": {"steps": [0, 2, 7], "values": [0.25, 0.5, 0.8]}}
    assert list(run_metrics.metric_series(store, run_id, "me", ["eval/acc"])) == ["eval/acc"]
    # The console's poll: every write after the last id seen, the replaced point again under a new id.
    points = run_metrics.points_after(store, run_id)
    assert [p["name"] for p in points] == ["reward/mean", "reward/max", "reward/mean", "eval/acc", "reward/mean"]
    assert [p["id"] for p in points] == sorted(p["id"] for p in points)
    assert points[-1]["value"] == 0.8 and points[-1]["step"] == 7
    assert run_metrics.points_after(store, run_id, after=points[-1]["id"]) == []
    assert run_metrics.points_after(store, run_id, after=points[-2]["id"]) == points[-1:]
    # Values are stored in double precision on both databases.
    run_metrics.log_metrics(store, run_id, "me", {"precise": 0.1 + 0.2}, step=0)
    assert run_metrics.metric_series(store, run_id, "me", ["precise"])["precise"]["values"] == [0.1 + 0.2]


def test_owner_only_and_ended_runs(store):
    run_id = new_run(store, "me")
    with pytest.raises(NotFound):
        run_metrics.log_metrics(store, run_id, "someone-else", {"reward": 1.0})
    with pytest.raises(NotFound):
        run_metrics.metric_series(store, run_id, "someone-else")
    with pytest.raises(NotFound):
        run_metrics.log_metrics(store, "run-nope", "me", {"reward": 1.0})
    # A finished (or cancelled) run still takes its final evaluation.
    assert store.set_run_status(run_id, RunStatus.FINISHED)
    run_metrics.log_metrics(store, run_id, "me", {"eval/final": 0.9}, step=3)
    assert run_metrics.metric_series(store, run_id, "me")["eval/final"]["values"] == [0.9]


@pytest.mark.parametrize("metrics, rule", [
    ({}, "at least one"),
    ({"": 1.0}, "1 to 128 characters"),
    ({"x" * 129: 1.0}, "1 to 128 characters"),
    ({"bad\nname": 1.0}, "control characters"),
    ({" padded": 1.0}, "leading/trailing spaces"),
    ({"reward": math.nan}, "'reward' must be a finite number"),
    ({"reward": math.inf}, "'reward' must be a finite number"),
    ({"reward": True}, "'reward' must be a number"),
    ({"reward": "1.0"}, "'reward' must be a number"),
])
def test_bad_names_and_values(store, metrics, rule):
    run_id = new_run(store)
    with pytest.raises(InvalidInput, match=rule) as e:
        run_metrics.log_metrics(store, run_id, "me", metrics)
    assert e.value.field == "metrics"
    assert run_metrics.points_after(store, run_id) == []  # nothing of a refused request is stored


def test_limits(store):
    run_id = new_run(store)
    limits = MetricLimits(max_names_per_request=3, max_names_per_run=4, max_points_per_run=6)
    with pytest.raises(TooLarge, match="4 names; the limit is 3 per request"):
        run_metrics.log_metrics(store, run_id, "me", {f"m{i}": 1.0 for i in range(4)}, 0, limits)
    run_metrics.log_metrics(store, run_id, "me", {"a": 1.0, "b": 2.0, "c": 3.0}, 0, limits)
    with pytest.raises(TooLarge, match="5 distinct metric names; the limit is 4 per run"):
        run_metrics.log_metrics(store, run_id, "me", {"d": 1.0, "e": 1.0}, 1, limits)
    run_metrics.log_metrics(store, run_id, "me", {"a": 1.0, "b": 2.0, "d": 4.0}, 1, limits)  # 6 points
    # Replacing points at a step adds none: allowed at the limit; a new point is not.
    run_metrics.log_metrics(store, run_id, "me", {"a": 9.0, "b": 9.0}, 1, limits)
    with pytest.raises(TooLarge, match="holds 6 metric points, 1 more would pass the limit of 6 per run"):
        run_metrics.log_metrics(store, run_id, "me", {"a": 1.0}, 2, limits)
    assert len(run_metrics.points_after(store, run_id)) == 6


def test_concurrent_writers_of_one_point_leave_one(store):
    """Threads logging the same (name, step) at once: one point remains, holding one of their values."""
    run_id = new_run(store)
    errors: list[BaseException] = []

    def log(value: float) -> None:
        try:
            for _ in range(5):
                run_metrics.log_metrics(store, run_id, "me", {"reward": value, f"own/{value}": value}, step=4)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=log, args=(float(i),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    series = run_metrics.metric_series(store, run_id, "me")
    assert series["reward"]["steps"] == [4] and series["reward"]["values"][0] in (0.0, 1.0, 2.0, 3.0)
    assert len(series) == 5


def test_table_created_on_a_database_made_before_it(store):
    """A database that lacks the table (made by a version without it) gets it when the store opens it."""
    with store.engine.begin() as conn:
        conn.execute(text("DROP TABLE run_metrics"))
    reopened = Store(store.engine.url.render_as_string(hide_password=False))
    run_id = new_run(reopened)
    run_metrics.log_metrics(reopened, run_id, "me", {"reward": 1.5}, step=1)
    assert run_metrics.metric_series(reopened, run_id, "me") == {"reward": {"steps": [1], "values": [1.5]}}
    reopened.engine.dispose()


# ---- the routes, over HTTP ---------------------------------------------------------------------------

@pytest.fixture
def server(make_server):
    return make_server(api_keys=[KEY_A, KEY_B])


def test_routes_log_list_and_default_to_the_optimizer_step(server):
    with Client(server.url, api_key=KEY_A) as client:
        run = client.create_session().create_run(rank=4)
        assert run.log_metrics({"reward/mean": 0.125, "reward/std": 2})["step"] == 0
        batch = [sft_datum(p, c) for p, c in EXAMPLES]
        for _ in range(2):
            run.forward_backward(batch)
            run.optim_step(learning_rate=1e-3).result()
        logged = run.log_metrics({"reward/mean": 0.5})
        assert logged == {"run_id": run.id, "step": 2, "metrics": {"reward/mean": 0.5}}
        run.log_metrics({"eval/score": -3.5}, step=10)
        assert run.metrics() == {"eval/score": {"steps": [10], "values": [-3.5]},
                                 "reward/mean": {"steps": [0, 2], "values": [0.125, 0.5]},
                                 "reward/std": {"steps": [0], "values": [2.0]}}
        assert set(run.metrics("reward/mean", "eval/score")) == {"reward/mean", "eval/score"}
        # After finish, the final evaluation is still taken.
        run.finish()
        run.log_metrics({"eval/final": 0.75}, step=2)
        assert run.metrics("eval/final") == {"eval/final": {"steps": [2], "values": [0.75]}}


def test_routes_refuse_other_keys_and_bad_input(server):
    with Client(server.url, api_key=KEY_A) as client:
        run = client.create_session().create_run(rank=4)
    with server.http(KEY_B) as other:
        for r in (other.post(f"/v1/runs/{run.id}/metrics", json={"metrics": {"reward": 1.0}}),
                  other.get(f"/v1/runs/{run.id}/metrics")):
            assert r.status_code == 404 and r.json()["code"] == "not_found", r.text
    with server.http() as anonymous:
        assert anonymous.get(f"/v1/runs/{run.id}/metrics").status_code == 401
    with server.http(KEY_A) as http:
        url = f"/v1/runs/{run.id}/metrics"
        # NaN and Infinity as JSON literals (Python's json writes them): a 400 naming the metric.
        for literal in ("NaN", "Infinity", "-Infinity"):
            r = http.post(url, content=f'{{"metrics": {{"reward/mean": {literal}}}}}',
                          headers={"Content-Type": "application/json"})
            assert r.status_code == 400, (literal, r.text)
            body = r.json()
            assert body["code"] == "invalid_input" and body["field"] == "metrics"
            assert "'reward/mean' must be a finite number" in body["message"]
        r = http.post(url, json={"metrics": {"x" * 200: 1.0}})
        assert r.status_code == 400 and "1 to 128 characters" in r.json()["message"]
        r = http.post(url, json={"metrics": {}})
        assert r.status_code == 400 and "at least one" in r.json()["message"]
        r = http.post(url, json={"metrics": {f"m{i}": 1.0 for i in range(257)}})
        assert r.status_code == 413 and r.json() == {
            "code": "too_large", "field": "metrics",
            "message": "metrics holds 257 names; the limit is 256 per request"}
        # Not the schema: a 422 naming the field (a string value, a bool, a negative step, an unknown field).
        for body, field in (({"metrics": {"r": "1"}}, "metrics"), ({"metrics": {"r": True}}, "metrics"),
                            ({"metrics": {"r": 1.0}, "step": -1}, "step"),
                            ({"metrics": {"r": 1.0}, "stepp": 1}, "stepp")):
            r = http.post(url, json=body)
            assert r.status_code == 422 and r.json()["code"] == "invalid_request", (body, r.text)
            assert field in r.json()["field"], (body, r.json())
        assert http.get(url).json() == {"run_id": run.id, "metrics": {}}  # nothing refused was stored
        assert http.post("/v1/runs/run-nope/metrics", json={"metrics": {"r": 1.0}}).status_code == 404


def test_client_raises_the_servers_error(server):
    with Client(server.url, api_key=KEY_A) as client:
        run = client.create_session().create_run(rank=4)
        with pytest.raises(WhitneyAPIError) as e:
            run.log_metrics({"reward": float("nan")})
        assert e.value.status == 400 and e.value.field == "metrics"
