"""The console's queries on a real SQLite file and a real PostgreSQL server (the JSON paths they select are
evaluated by each database in its own dialect), and its pages on an open server (no keys)."""

from __future__ import annotations

import httpx
import pytest

from tests.service.conftest import start_server
from whitney.service.app import ServiceConfig
from whitney.service.console import queries
from whitney.service.lifecycle import OperationKind, OperationStatus
from whitney.service.store import Store

# A forward_backward's result holds every token's log-prob; the curves must not need them.
FB_RESULT = {"loss": 12.0, "metrics": {"loss:sum": 12.0, "tokens:sum": 4.0, "ratio:mean": 1.5},
             "outputs": [{"logprobs": [-1.0] * 4, "elementwise_loss": [3.0] * 4}]}
OPTIM_RESULT = {"metrics": {"grad_norm": 2.5, "step": 1.0, "learning_rate": 1e-3, "learning_rate_lora_B": 1e-3}}


def operation(store: Store, run_id: str, seq_id: int, kind: OperationKind, status: OperationStatus,
              result: dict | None = None, error: dict | None = None) -> str:
    op, _ = store.submit_operation("me", run_id, seq_id, kind, f"d{seq_id}")
    if status != OperationStatus.QUEUED:
        store.set_operation(op["id"], OperationStatus.RUNNING)
        if status != OperationStatus.RUNNING:
            store.set_operation(op["id"], status, result=result, error=error)
    return op["id"]


def test_curves_timeline_versions_and_counts(store):
    session = store.create_session("me")
    run_id = store.create_run(session["id"], "me", "tiny", {"rank": 4}, None, False, None)["id"]
    operation(store, run_id, 0, OperationKind.FORWARD_BACKWARD, OperationStatus.SUCCEEDED, FB_RESULT)
    operation(store, run_id, 1, OperationKind.OPTIM_STEP, OperationStatus.SUCCEEDED, OPTIM_RESULT)
    package = store.register_package(run_id, "me", "sampler", "1", "/nowhere", "tiny")
    operation(store, run_id, 2, OperationKind.SAVE_WEIGHTS_FOR_SAMPLER, OperationStatus.SUCCEEDED,
              {"version": 1, "package": {"id": package["id"], "kind": "sampler"}})
    error = {"code": "invalid_input", "message": "datum 1: bad", "field": "target_tokens", "datum_index": 1,
             "category": "user"}
    operation(store, run_id, 3, OperationKind.FORWARD_BACKWARD, OperationStatus.FAILED, error=error)
    operation(store, run_id, 4, OperationKind.FORWARD, OperationStatus.RUNNING)
    operation(store, run_id, 6, OperationKind.OPTIM_STEP, OperationStatus.QUEUED)  # waits for seq 5

    points = queries.curve_points(store, run_id)
    assert [(p["seq"], p["kind"]) for p in points] == [(0, "forward_backward"), (1, "optim_step")]
    assert points[0]["loss"] == 12.0 and points[0]["metrics"] == FB_RESULT["metrics"]
    assert "outputs" not in points[0]
    assert points[1]["loss"] is None and points[1]["metrics"]["grad_norm"] == 2.5
    assert queries.curve_points(store, run_id, after=0) == points[1:]
    assert queries.curve_points(store, run_id, after=1) == []

    rows = queries.timeline(store, run_id)
    assert [r["seq"] for r in rows] == [6, 4, 3, 2, 1, 0]
    assert rows[0]["status"] == "queued" and rows[0]["queued_s"] is None and rows[0]["ran_s"] is None
    assert rows[1]["status"] == "running" and rows[1]["queued_s"] >= 0 and rows[1]["ran_s"] is None
    assert rows[2]["error"] == error and rows[2]["ran_s"] >= 0

    assert queries.sampler_versions(store, run_id)[0]["version"] == 1
    assert queries.sampler_versions(store, run_id)[0]["package_id"] == package["id"]
    assert queries.owner_sampler_versions(store, "me", [run_id]) == {run_id: [(1, package["id"])]}
    assert queries.owner_sampler_versions(store, "someone else", [run_id]) == {}
    counts = queries.operation_counts(store, [run_id])[run_id]
    assert counts == {"steps": 1, "succeeded": 3, "failed": 1, "running": 1, "queued": 1}
    assert queries.last_losses(store, [run_id]) == {run_id: 3.0}  # 12 over 4 tokens
    assert queries.recent_losses(store, [run_id]) == {run_id: [3.0]}
    assert queries.queue_depth(store) == {"training_queued": 1, "training_running": 1, "sampling_queued": 0,
                                          "sampling_running": 0}
    assert queries.owner_summary(store, "me") == {"sessions": 1, "runs": 1, "checkpoints": 1, "pending": 2}
    assert queries.owner_summary(store, "someone else") == {"sessions": 0, "runs": 0, "checkpoints": 0, "pending": 0}


def test_open_server_console_needs_no_key(tmp_path, tiny_llama):
    """Without keys every page answers (one anonymous owner); unknown runs are a 404 page, not a 500."""
    server = start_server(ServiceConfig(models=[tiny_llama], data_dir=tmp_path / "data"))
    try:
        with httpx.Client(base_url=server.url, timeout=30, headers={"Accept": "text/html"}) as http:
            for path in ("/console/", "/console/playground", "/console/server", "/console/login"):
                r = http.get(path)
                assert r.status_code == 200, (path, r.status_code)
                assert "Content-Security-Policy" in r.headers
            assert "no API keys" in http.get("/console/").text
            assert "tiny-llama" in http.get("/console/server").text
            missing = http.get("/console/runs/run-nope")
            assert missing.status_code == 404 and "does not exist" in missing.text
            assert http.get("/console").status_code in (200, 307)  # redirected to /console/
            curves = http.get("/console/runs/run-nope/curves", headers={"Accept": "application/json"})
            assert curves.status_code == 404 and curves.json()["code"] == "not_found"
    finally:
        server.stop()
