"""The store without HTTP, on a real SQLite file and a real PostgreSQL server (each test runs on both): the
status tables, idempotent submission under concurrent writers, restart recovery."""

from __future__ import annotations

import pytest
from sqlalchemy import event, inspect, text

from whitney.errors import Conflict, NotFound
from whitney.service.store.database import Store, digest
from whitney.service.store.lifecycle import (OPERATION_MOVES, OPERATION_PENDING, OPERATION_TERMINAL, RUN_LIVE,
                                             RUN_MOVES, RUN_OPEN, RUN_TERMINAL, OperationKind, OperationStatus,
                                             RunStatus, SessionStatus, sources)


def new_run(store: Store, owner: str = "me", status: RunStatus = RunStatus.ACTIVE) -> str:
    """A run of a new session, moved to `status` in one step (every status is one move from active)."""
    session = store.create_session(owner)
    run = store.create_run(session.id, owner, "tiny", {"rank": 4}, None, False, None)
    if status != RunStatus.ACTIVE:
        assert store.set_run_status(run.id, status)
    return run.id


def new_operation(store: Store, status: OperationStatus = OperationStatus.QUEUED) -> str:
    """A sampling operation (no run), moved to `status` through running."""
    op, created = store.submit_operation("me", None, None, OperationKind.SAMPLE, "")
    assert created and op.status == OperationStatus.QUEUED
    if status != OperationStatus.QUEUED:
        if status != OperationStatus.RUNNING:
            assert store.set_operation(op.id, OperationStatus.RUNNING)
        assert store.set_operation(op.id, status)
    return op.id


# ---- the tables ----------------------------------------------------------------------------------


def test_tables_cover_every_status_and_their_sets_agree():
    assert set(RUN_MOVES) == set(RunStatus) and set(OPERATION_MOVES) == set(OperationStatus)
    assert set(RUN_TERMINAL) == {"finished", "cancelled", "failed", "interrupted"}
    assert set(RUN_LIVE) == {"active", "finishing", "cancelling"} == set(RunStatus) - set(RUN_TERMINAL)
    assert set(RUN_OPEN) == {"active", "finishing"} == set(sources(RUN_MOVES, RunStatus.CANCELLING))
    assert set(OPERATION_TERMINAL) == {"succeeded", "failed", "cancelled"}
    assert set(OPERATION_PENDING) == {"queued", "running"}
    assert not sources(RUN_MOVES, RunStatus.ACTIVE), "nothing moves back to active"
    assert not sources(OPERATION_MOVES, OperationStatus.QUEUED), "nothing moves back to queued"


def test_enums_equal_their_strings_in_the_database(store):
    run_id = new_run(store, status=RunStatus.FINISHING)
    op_id = new_operation(store, OperationStatus.RUNNING)
    assert RunStatus.FINISHING == "finishing" and f"{OperationKind.FORWARD_BACKWARD}" == "forward_backward"
    assert digest({"kind": OperationKind.OPTIM_STEP}) == digest({"kind": "optim_step"}), "retries keep their digest"
    with store.engine.connect() as raw:  # plain SQL, past the ORM
        assert tuple(raw.execute(text("SELECT status FROM runs WHERE id = :id"), {"id": run_id}).one()) == \
            ("finishing",)
        assert tuple(raw.execute(text("SELECT kind, status FROM operations WHERE id = :id"), {"id": op_id}).one()) == \
            ("sample", "running")
    assert type(store.get_run(run_id).status) is RunStatus  # records read back as the enum (equal to its string)


@pytest.mark.parametrize("frm,to", [(f, t) for f, moves in RUN_MOVES.items() for t in moves])
def test_every_allowed_run_move_works(store, frm, to):
    run_id = new_run(store, status=frm)
    assert store.set_run_status(run_id, to), f"{frm} -> {to} is listed but refused"
    assert store.get_run(run_id).status == to


@pytest.mark.parametrize("frm,to", [(f, t) for f in RunStatus for t in RunStatus if t not in RUN_MOVES[f]])
def test_every_other_run_move_is_refused_and_changes_nothing(store, frm, to):
    run_id = new_run(store, status=frm)
    assert not store.set_run_status(run_id, to, error="should not be written")
    run = store.get_run(run_id)
    assert run.status == frm and run.error is None


def test_run_moves_race_like_the_routes_do(store):
    """finish vs cancel: the second mover loses; a cancelled run is never then marked finished."""
    run_id = new_run(store)
    assert store.set_run_status(run_id, RunStatus.FINISHING)
    assert not store.set_run_status(run_id, RunStatus.FINISHING), "a second finish is refused"
    assert store.set_run_status(run_id, RunStatus.CANCELLING)
    assert store.set_run_status(run_id, RunStatus.CANCELLED)
    assert not store.set_run_status(run_id, RunStatus.FINISHED), "the drained finish lost the race"
    assert store.get_run(run_id).status == RunStatus.CANCELLED


def test_run_status_error_unknown_run_and_unknown_status(store):
    run_id = new_run(store)
    assert store.set_run_status(run_id, RunStatus.FAILED, error="worker lost")
    assert store.get_run(run_id).error == "worker lost"
    assert not store.set_run_status("run-nope", RunStatus.CANCELLED)
    with pytest.raises(ValueError):
        store.set_run_status(run_id, "paused")


@pytest.mark.parametrize("frm,to", [(f, t) for f in OperationStatus for t in OperationStatus])
def test_operation_moves_follow_the_table(store, frm, to):
    op_id = new_operation(store, frm)
    before = store.get_operation(op_id)
    moved = store.set_operation(op_id, to, result={"x": 1}, error=None)
    assert moved == (to in OPERATION_MOVES[frm])
    op = store.get_operation(op_id)
    if not moved:
        assert op == before
        return
    assert op.status == to
    if to == OperationStatus.RUNNING:
        assert op.started_at is not None and op.finished_at is None
    if to in OPERATION_TERMINAL:
        assert op.finished_at is not None and op.result == {"x": 1}


def test_sessions_end_once(store):
    session = store.create_session("me")
    assert store.end_session(session.id, SessionStatus.CLOSED)
    assert not store.end_session(session.id, SessionStatus.EXPIRED)
    assert store.get_session(session.id, "me").status == SessionStatus.CLOSED
    with pytest.raises(Conflict):
        store.heartbeat(session.id, "me")


# ---- submitting an operation -----------------------------------------------------------------------


def test_same_body_is_the_same_operation_and_a_different_one_a_conflict(store):
    run_id = new_run(store)
    op, created = store.submit_operation("me", run_id, 0, OperationKind.FORWARD_BACKWARD, "d0")
    assert created and op.status == OperationStatus.QUEUED and op.seq_id == 0
    again, created = store.submit_operation("me", run_id, 0, OperationKind.FORWARD_BACKWARD, "d0")
    assert not created and again.id == op.id
    with pytest.raises(Conflict) as e:
        store.submit_operation("me", run_id, 0, OperationKind.FORWARD_BACKWARD, "d1")
    assert e.value.field == "seq_id" and "already used for a different forward_backward request" in e.value.message
    with pytest.raises(Conflict):  # same digest, other kind
        store.submit_operation("me", run_id, 0, OperationKind.OPTIM_STEP, "d0")
    assert [o.id for o in store.list_operations(run_id)] == [op.id]


def test_unknown_or_foreign_run_is_not_found(store):
    theirs = new_run(store, owner="them")
    for run_id in ("run-nope", theirs):
        with pytest.raises(NotFound) as e:
            store.submit_operation("me", run_id, 0, OperationKind.FORWARD, "d")
        assert e.value.field == "run_id" and e.value.message == f"run {run_id!r} does not exist"
    assert store.list_operations(theirs) == []


@pytest.mark.parametrize("status", [s for s in RunStatus if s != RunStatus.ACTIVE])
def test_a_run_that_is_not_active_answers_retries_only(store, status):
    run_id = new_run(store)
    op, _ = store.submit_operation("me", run_id, 0, OperationKind.OPTIM_STEP, "d0")
    assert store.set_run_status(run_id, status)
    again, created = store.submit_operation("me", run_id, 0, OperationKind.OPTIM_STEP, "d0")
    assert not created and again.id == op.id
    with pytest.raises(Conflict) as e:
        store.submit_operation("me", run_id, 1, OperationKind.OPTIM_STEP, "d1")
    assert e.value.field == "run_id"
    assert e.value.message == f"run {run_id!r} is {status}; it takes no more operations"
    with pytest.raises(Conflict) as e:  # a retry with another body is still the seq_id's conflict
        store.submit_operation("me", run_id, 0, OperationKind.OPTIM_STEP, "d2")
    assert e.value.field == "seq_id"


def test_admit_runs_for_new_operations_only_and_its_refusal_stores_nothing(store):
    run_id = new_run(store)
    calls = []

    class Refused(Exception):
        pass

    def refuse(conn):
        calls.append("refuse")
        raise Refused

    with pytest.raises(Refused):
        store.submit_operation("me", run_id, 0, OperationKind.FORWARD, "d0", admit=refuse)
    assert store.find_operation(run_id, 0) is None and store.usage("me")["operations"] == 0
    op, created = store.submit_operation("me", run_id, 0, OperationKind.FORWARD, "d0", admit=lambda conn: calls.append("ok"))
    assert created and calls == ["refuse", "ok"]
    store.submit_operation("me", run_id, 0, OperationKind.FORWARD, "d0", admit=refuse)  # a retry: not checked
    for run, seq in (("run-nope", 0), (run_id, 0)):  # not found; a different body: refused before the quota
        with pytest.raises((NotFound, Conflict)):
            store.submit_operation("me", run, seq, OperationKind.FORWARD, "other", admit=refuse)
    assert store.set_run_status(run_id, RunStatus.FINISHED)
    with pytest.raises(Conflict):  # an ended run: refused before the quota
        store.submit_operation("me", run_id, 1, OperationKind.FORWARD, "d1", admit=refuse)
    assert calls == ["refuse", "ok"]


def test_pending_before_counts_the_owners_queued_and_running_unless_a_later_seq_id_waits(store):
    """The queue limit's count: queued and running operations of the owner only (ended ones, another owner's
    and sampling ones of another owner not), or None when a later seq_id of the run is queued already."""
    run_id, other = new_run(store), new_run(store, owner="you")
    assert store.pending_before("me", run_id, 0) == 0 and store.pending_before("me", None, None) == 0
    ops = [store.submit_operation("me", run_id, seq, OperationKind.FORWARD, f"d{seq}")[0].id for seq in (0, 1)]
    store.submit_operation("you", other, 0, OperationKind.FORWARD, "d")
    new_operation(store)  # a sampling one of "me", queued
    assert store.pending_before("me", run_id, 2) == 3 and store.pending_before("me", None, None) == 3
    assert store.pending_before("me", run_id, 0) is None  # seq_id 1 waits for seq_id 0
    assert store.set_operation(ops[0], OperationStatus.RUNNING)
    assert store.pending_before("me", run_id, 2) == 3  # running still counts
    assert store.set_operation(ops[0], OperationStatus.SUCCEEDED)
    assert store.set_operation(ops[1], OperationStatus.RUNNING) and store.set_operation(ops[1], OperationStatus.FAILED)
    assert store.pending_before("me", run_id, 2) == 1 == store.usage("me")["operations"]
    assert store.pending_before("you", other, 1) == 1


def test_the_queue_count_reads_an_index_of_owner_and_status_not_the_owners_history(store):
    """Every submission counts its owner's pending operations: by the (owner, status) index (which SQLite's
    planner takes; PostgreSQL's plans a table this small as a scan, so there the index is checked to exist)."""
    indexes = {i["name"]: i["column_names"] for i in inspect(store.engine).get_indexes("operations")}
    assert indexes.get("ix_operations_owner_status") == ["owner", "status"], indexes
    if store.engine.dialect.name != "sqlite":
        return
    with store.engine.connect() as conn:
        plan = " ".join(str(row[-1]) for row in conn.execute(text(
            "EXPLAIN QUERY PLAN SELECT count(*) FROM operations WHERE owner = 'me' AND status IN ('queued', 'running')")))
    assert "ix_operations_owner_status" in plan, plan


def test_many_concurrent_submissions_with_a_quota_check_that_reads_the_store(store):
    """`admit` reads the store (as the quotas do) through the connection of the transaction that inserts (its quota
    lock held): were it to ask the pool for a second, 40 submissions at once would each hold one of the pool's 15
    and wait for a second until the pool's 30 s timeout (a 500 each)."""
    import threading
    import time as _time

    runs = [new_run(store) for _ in range(40)]
    start, errors, done = threading.Barrier(40), [], []
    held: dict[int, int] = {}  # pool connections each thread holds now
    most = [0]  # the most one thread held at once: a second while holding one is the bug

    def checkout(*_) -> None:
        held[threading.get_ident()] = held.get(threading.get_ident(), 0) + 1
        most[0] = max(most[0], held[threading.get_ident()])

    event.listen(store.engine.pool, "checkout", checkout)
    event.listen(store.engine.pool, "checkin", lambda *_: held.update(
        {threading.get_ident(): held.get(threading.get_ident(), 0) - 1}))

    def submit(run_id: str) -> None:
        start.wait()
        try:
            op, created = store.submit_operation("me", run_id, 0, "forward_backward", "d",
                                                 admit=lambda conn: (store.pending_before("me", None, None, conn),
                                                                     _time.sleep(0.01)))
            done.append(created)
        except Exception as e:  # noqa: BLE001 (any failure is the bug)
            errors.append(repr(e))

    threads = [threading.Thread(target=submit, args=(r,)) for r in runs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and done == [True] * 40, errors[:3]
    assert most[0] == 1, "a submission asked the pool for a connection while holding one"


def test_a_racing_duplicate_resolves_through_the_constraint(store, monkeypatch):
    """Another request inserts the same (run, seq_id) between this one's checks and its insert (as the transaction
    that admits and inserts begins)."""
    run_id = new_run(store)
    first, racing, quota_tx = [], [], store.quota_tx

    def raced(owner: str):
        if racing:
            first.append(store.submit_operation("me", run_id, len(first), OperationKind.FORWARD, racing.pop())[0])
        return quota_tx(owner)

    monkeypatch.setattr(store, "quota_tx", raced)
    racing.append("d0")
    op, created = store.submit_operation("me", run_id, 0, OperationKind.FORWARD, "d0", admit=lambda conn: None)
    assert not created and op.id == first[0].id
    racing.append("other")
    with pytest.raises(Conflict):
        store.submit_operation("me", run_id, 1, OperationKind.FORWARD, "d1", admit=lambda conn: None)
    assert len(store.list_operations(run_id)) == 2


def test_concurrent_writers_keep_run_seq_unique_and_lose_nothing(store, db_url):
    """Two stores on one database (two API worker processes) and 16 threads submit the same 10 seq_ids of
    one run, the same bodies, at once: each (run, seq_id) is stored once, every answer names that one
    operation, and every result written meanwhile reads back."""
    import threading

    other = Store(db_url)
    run_id = new_run(store)
    start, answers, errors = threading.Barrier(16), {}, []

    def worker(i: int) -> None:
        mine = (store, other)[i % 2]
        start.wait()
        try:
            for seq in range(10):
                op, _ = mine.submit_operation("me", run_id, seq, OperationKind.FORWARD, f"body-{seq}")
                answers.setdefault(seq, set()).add(op.id)
                if mine.set_operation(op.id, OperationStatus.RUNNING):  # one writer wins each move
                    assert mine.set_operation(op.id, OperationStatus.SUCCEEDED, result={"loss": float(seq)})
        except Exception as e:  # noqa: BLE001 (any failure is the bug)
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors[:3]
    assert all(len(ids) == 1 for ids in answers.values()) and len(answers) == 10
    stored = store.list_operations(run_id)
    assert sorted(op.seq_id for op in stored) == list(range(10))
    for op in stored:
        assert op.status == OperationStatus.SUCCEEDED and op.result == {"loss": float(op.seq_id)}


def test_sampling_operations_are_never_deduplicated(store):
    a, _ = store.submit_operation("me", None, None, OperationKind.SAMPLE, "")
    b, created = store.submit_operation("me", None, None, OperationKind.SAMPLE, "")
    assert created and a.id != b.id
    with pytest.raises(ValueError):
        store.submit_operation("me", None, None, "teleport", "")


# ---- restart recovery ---------------------------------------------------------------------------------


def test_recover_after_restart(store, db_url):
    ops = {s: new_operation(store, s) for s in OperationStatus}
    runs = {s: new_run(store, status=s) for s in RunStatus}
    Store(db_url).recover_after_restart()  # the next process, on the same database
    for status, op_id in ops.items():
        op = store.get_operation(op_id)
        if status in OPERATION_PENDING:
            assert op.status == OperationStatus.FAILED and op.finished_at is not None
            assert op.error["category"] == "server" and op.error["code"] == "server_restarted"
        else:
            assert op.status == status
    for status, run_id in runs.items():
        run = store.get_run(run_id)
        if status in RUN_LIVE:
            assert run.status == RunStatus.INTERRUPTED and "server restarted" in run.error
        else:
            assert run.status == status and run.error is None
    assert store.usage("me") == {"sessions": len(RunStatus), "runs": [], "operations": 0}


def test_stored_json_nested_too_deep_reads_back_cut_never_breaking_a_read(store):
    """Issue 31, item 8: a row nested deeper than any response can show (written before the edge checked, or
    straight into the database) reads back cut at json_values.MAX_DEPTH; one json.loads cannot parse, as a marker."""
    import json

    from whitney.service.store import json_values

    deep: object = ["x]}[{\\\"", {"k": "[[[["}]  # brackets inside strings are no nesting
    for _ in range(299):
        deep = {"a": deep}
    text_ = json.dumps(deep)
    assert json_values.depth_of(deep) == 301 and json_values.text_depth_over(text_, 300)
    assert not json_values.text_depth_over(text_, 301)
    session = store.create_session("me", {"ok": [1, [2, {"b": "]]]]"}]]})
    with store.tx() as db:
        db.execute(text("UPDATE sessions SET user_metadata = :m WHERE id = :i"), {"m": text_, "i": session.id})
    shown, depth = store.get_session(session.id, "me").user_metadata, 1
    while isinstance(shown, dict):
        shown, depth = shown["a"], depth + 1
    assert shown == json_values.TOO_DEEP and depth == json_values.MAX_DEPTH + 1
    with store.tx() as db:
        db.execute(text("UPDATE sessions SET user_metadata = :m WHERE id = :i"),
                   {"m": "[" * 5_000 + "]" * 5_000, "i": session.id})
    assert store.list_sessions("me")[0].user_metadata == json_values.UNREADABLE
    assert store.create_session("me", {"ok": [1, [2, {"b": "]]]]"}]]}).user_metadata == \
        store.list_sessions("me")[1].user_metadata == {"ok": [1, [2, {"b": "]]]]"}]]}
