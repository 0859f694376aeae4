"""The console's queries on a real SQLite file and a real PostgreSQL server (the JSON paths they select are
evaluated by each database in its own dialect): curves, timeline, counts; the runs search, a sampling request's
wait, the configuration panel's window, the CSV's rows; and its pages on an open server (no keys)."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import text

from tests.service.conftest import start_server
from whitney.errors import NotFound
from whitney.service.app import ServiceConfig
from whitney.service.console import configuration, curves_csv, queries
from whitney.service.store import run_metrics
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import OperationKind, OperationStatus, RunStatus

# A forward_backward's result holds every token's log-prob; the curves must not need them.
FB_RESULT = {"loss": 12.0, "metrics": {"loss:sum": 12.0, "tokens:sum": 4.0, "ratio:mean": 1.5},
             "outputs": [{"logprobs": [-1.0] * 4, "elementwise_loss": [3.0] * 4}]}
OPTIM_RESULT = {"metrics": {"grad_norm": 2.5, "step": 1.0, "learning_rate": 1e-3, "learning_rate_lora_B": 1e-3}}


def operation(store: Store, run_id: str, seq_id: int, kind: OperationKind, status: OperationStatus,
              result: dict | None = None, error: dict | None = None) -> str:
    op, _ = store.submit_operation("me", run_id, seq_id, kind, f"d{seq_id}")
    if status != OperationStatus.QUEUED:
        store.set_operation(op.id, OperationStatus.RUNNING)
        if status != OperationStatus.RUNNING:
            store.set_operation(op.id, status, result=result, error=error)
    return op.id


def test_curves_timeline_versions_and_counts(store):
    session = store.create_session("me")
    run_id = store.create_run(session.id, "me", "tiny", {"rank": 4}, None, False, None).id
    operation(store, run_id, 0, OperationKind.FORWARD_BACKWARD, OperationStatus.SUCCEEDED, FB_RESULT)
    operation(store, run_id, 1, OperationKind.OPTIM_STEP, OperationStatus.SUCCEEDED, OPTIM_RESULT)
    package = store.register_package(run_id, "me", "sampler", "1", "/nowhere", "tiny")
    operation(store, run_id, 2, OperationKind.SAVE_WEIGHTS_FOR_SAMPLER, OperationStatus.SUCCEEDED,
              {"version": 1, "package": {"id": package.id, "kind": "sampler"}})
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
    assert queries.sampler_versions(store, run_id)[0]["package_id"] == package.id
    assert queries.owner_sampler_versions(store, "me", [run_id]) == {run_id: [(1, package.id)]}
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


# ---- search, configuration, CSV, what a sample waits behind --------------------------------------------

def new_run(store: Store, owner: str = "me", session_metadata: dict | None = None, **run) -> str:
    session = store.create_session(owner, session_metadata)
    return store.create_run(session.id, owner, run.pop("base_model", "tiny"), run.pop("lora", {"rank": 4}),
                            None, False, run).id


def test_find_runs_by_words_and_status(store):
    a = new_run(store, experiment="LR-sweep-A", base_model="HuggingFaceTB/SmolLM2-135M")
    b = new_run(store, session_metadata={"project": "100%_done"}, experiment="lr-sweep-b")
    c = new_run(store, experiment="sft")
    other = new_run(store, "someone else", experiment="lr-sweep-z")
    store.set_run_status(c, RunStatus.FINISHED)
    found = lambda **kw: [r["id"] for r in queries.find_runs(store, "me", **kw)[0]]  # noqa: E731
    assert found() == [c, b, a]  # newest first, the owner's only
    assert found(text="sweep") == [b, a] and found(text="SWEEP smollm2") == [a]  # every word, any case
    assert found(text="smollm2") == [a]  # the base model
    assert found(text=a[-6:]) == [a]  # the run id
    assert found(text="100%_") == [b]  # the session's metadata; % and _ are literal
    assert found(text="100%x") == [] and found(text="1_0") == []
    assert found(status="finished") == [c] and found(status="live") == [b, a]
    assert found(text="sweep", status="finished") == []
    assert queries.find_runs(store, "me", limit=2) == (queries.find_runs(store, "me")[0][:2], 3)
    assert queries.find_runs(store, "someone else", text="sweep")[0][0]["id"] == other


def test_sample_wait_counts_what_is_ahead(store):
    run_id = new_run(store)
    running = operation(store, run_id, 0, OperationKind.FORWARD_BACKWARD, OperationStatus.RUNNING)
    operation(store, run_id, 1, OperationKind.OPTIM_STEP, OperationStatus.QUEUED)
    earlier, _ = store.submit_operation("someone else", None, None, OperationKind.SAMPLE, "")
    mine, _ = store.submit_operation("me", None, None, OperationKind.SAMPLE, "")
    later_run = new_run(store)
    operation(store, later_run, 0, OperationKind.FORWARD_BACKWARD, OperationStatus.QUEUED)  # after mine: not ahead
    wait = queries.sample_wait(store, "me", mine.id)
    assert wait["status"] == "queued" and wait["ahead"] == 3 and wait["waited_s"] >= 0
    assert wait["behind"] == [{"kind": "forward_backward", "status": "running", "count": 1},
                              {"kind": "optim_step", "status": "queued", "count": 1},
                              {"kind": "sample", "status": "queued", "count": 1}]
    # Started: the samples queued before it are behind it now; the engine's training is still ahead.
    store.set_operation(mine.id, OperationStatus.RUNNING)
    assert queries.sample_wait(store, "me", mine.id)["ahead"] == 2
    store.set_operation(running, OperationStatus.SUCCEEDED, result={"loss": 1.0, "metrics": {}})
    store.set_operation(earlier.id, OperationStatus.RUNNING)
    assert queries.sample_wait(store, "me", mine.id)["behind"] == [
        {"kind": "optim_step", "status": "queued", "count": 1}]
    store.set_operation(mine.id, OperationStatus.SUCCEEDED, result={})
    assert queries.sample_wait(store, "me", mine.id)["ahead"] == 0
    with pytest.raises(NotFound):
        queries.sample_wait(store, "someone else", mine.id)  # another key's request


def configured(store: Store, run_id: str, seq_id: int, kind: OperationKind, config: dict) -> None:
    op, _ = store.submit_operation("me", run_id, seq_id, kind, f"d{seq_id}", config=config)
    store.set_operation(op.id, OperationStatus.RUNNING)
    store.set_operation(op.id, OperationStatus.SUCCEEDED, result={"loss": 1.0, "metrics": {}})


def adam(lr: float, **more) -> dict:
    return {"adam_params": {"learning_rate": lr, "beta1": 0.9, "weight_decay": 0.0, **more}}


def test_summarize_settings():
    by = {r["name"]: r for r in configuration.summarize([adam(1e-4), adam(2e-4), adam(1e-4, weight_decay=0.1)])}
    assert by["learning_rate"] == {"name": "learning_rate", "latest": 1e-4, "distinct": 2, "values": [],
                                   "low": 1e-4, "high": 2e-4}  # a number that changed: its range
    assert by["beta1"] == {"name": "beta1", "latest": 0.9, "distinct": 1, "values": [0.9], "low": None, "high": None}
    assert (by["weight_decay"]["latest"], by["weight_decay"]["high"]) == (0.0, 0.1)
    # Losses that changed: each distinct value, newest first; a key one loss lacks counts as None.
    by = {r["name"]: r for r in configuration.summarize([{"loss_fn": "ppo", "loss_config": {"clip_low_threshold": 0.8}},
                                                          {"loss_fn": "cross_entropy", "loss_config": {}}])}
    assert by["loss_fn"]["values"] == ["ppo", "cross_entropy"] and by["loss_fn"]["distinct"] == 2
    assert by["loss_config.clip_low_threshold"]["values"] == [0.8, None]
    assert configuration.summarize([{"loss_fn": "custom", "loss_config_bytes": 9000}])[1] == {
        "name": "loss_config", "latest": "(9,000 bytes)", "distinct": 1, "values": ["(9,000 bytes)"],
        "low": None, "high": None}
    assert configuration.targets({"target_modules": ["q_proj", "v_proj"]}) == "q_proj, v_proj"
    assert configuration.targets({"train_attn": True, "train_mlp": False, "train_unembed": False}) == "attention"


def test_run_config_reads_a_bounded_window(store, monkeypatch):
    """The newest WINDOW operations of each kind and the first: a schedule's range over them, the first value kept."""
    monkeypatch.setattr(configuration, "WINDOW", 4)
    run_id = new_run(store, lora={"rank": 8, "alpha": 16.0, "seed": 3, "train_unembed": False})
    seq = 0
    for lr in (9e-3, 5e-3, 4e-3, 3e-3, 2e-3, 1e-3):
        configured(store, run_id, seq, OperationKind.FORWARD_BACKWARD,
                   {"loss_fn": "importance_sampling", "loss_config": {}})
        configured(store, run_id, seq + 1, OperationKind.OPTIM_STEP, adam(lr))
        seq += 2
    operation(store, run_id, seq, OperationKind.SAVE_STATE, OperationStatus.SUCCEEDED, {})  # no config
    config = configuration.run_config(store, store.get_run(run_id))
    assert (config["rank"], config["alpha"], config["seed"], config["targets"]) == (8, 16.0, 3, "attention, MLP")
    sections = {s["kind"]: s for s in config["sections"]}
    assert set(sections) == {"forward_backward", "optim_step"}
    optim = sections["optim_step"]
    assert optim["seen"] == 5 and optim["cut"]  # the newest 4 and the first; 5e-3 left out
    lr = next(s for s in optim["settings"] if s["name"] == "learning_rate")
    assert (lr["latest"], lr["low"], lr["high"], lr["distinct"]) == (1e-3, 1e-3, 9e-3, 5)
    loss = sections["forward_backward"]["settings"]
    assert loss == [{"name": "loss_fn", "latest": "importance_sampling", "distinct": 1,
                     "values": ["importance_sampling"], "low": None, "high": None}]
    if store.engine.dialect.name == "sqlite":  # the window is a walk of the (run_id, seq_id) index, never a sort
        query = configuration.configs_query(run_id, OperationKind.OPTIM_STEP, newest=True).limit(4)
        with store.engine.connect() as conn:
            plan = " ".join(str(row) for row in conn.execute(text("EXPLAIN QUERY PLAN " + str(query.compile(
                store.engine, compile_kwargs={"literal_binds": True})))))
        assert "USING INDEX sqlite_autoindex_operations" in plan and "TEMP B-TREE" not in plan, plan


def test_csv_rows_are_the_points_as_stored(store):
    run_id = new_run(store)
    operation(store, run_id, 0, OperationKind.FORWARD_BACKWARD, OperationStatus.SUCCEEDED, FB_RESULT)
    operation(store, run_id, 1, OperationKind.OPTIM_STEP, OperationStatus.SUCCEEDED, OPTIM_RESULT)
    precise = {"loss": 0.1 + 0.2, "metrics": {"tokens:sum": 3.0}}
    operation(store, run_id, 2, OperationKind.FORWARD, OperationStatus.SUCCEEDED, precise)
    operation(store, run_id, 3, OperationKind.FORWARD_BACKWARD, OperationStatus.FAILED, error={"code": "x"})
    run_metrics.log_metrics(store, run_id, "me", {"reward/mean": 0.25}, step=1)
    rows = list(curves_csv.rows(store, run_id, page=1))  # a page per point: the paging is exercised too
    ends = {op.seq_id: op.finished_at for op in store.list_operations(run_id)}
    assert [row[:5] for row in rows] == [
        ("forward_backward", 0, 1, "loss", 12.0), ("forward_backward", 0, 1, "loss:sum", 12.0),
        ("forward_backward", 0, 1, "ratio:mean", 1.5), ("forward_backward", 0, 1, "tokens:sum", 4.0),
        ("optim_step", 1, 1, "grad_norm", 2.5), ("optim_step", 1, 1, "learning_rate", 1e-3),
        ("optim_step", 1, 1, "learning_rate_lora_B", 1e-3), ("optim_step", 1, 1, "step", 1.0),
        ("forward", 2, 2, "loss", 0.1 + 0.2), ("forward", 2, 2, "tokens:sum", 3.0),
        ("logged", "", 1, "reward/mean", 0.25)]
    assert [row[5] for row in rows[:-1]] == [ends[row[1]] for row in rows[:-1]]
    text = "".join(curves_csv.lines(store, run_id))
    assert text.splitlines()[0] == "source,seq_id,step,name,value,time"
    assert "forward,2,2,loss,0.30000000000000004," in text  # full precision, exact on both databases
