"""The scheduler's grouped work: a batch's store writes in one transaction (`Store.set_operations`), every
ready optim_step in one backend call (`optim_steps`), and sampling given a time share equal to the last
training iteration's, so a short sample is not held up one decode step per training call."""

from __future__ import annotations

import threading
import time

from sqlalchemy import event

from tests.service.test_fake_backend import FakeBackend, fb, scheduler_over, wait
from whitney.engine import AdamParams
from whitney.protocol.backend import Weights
from whitney.protocol.sampling import SamplingParams
from whitney.service.scheduling.jobs import OptimJob
from whitney.service.store.database import Store, digest
from whitney.service.store.lifecycle import OperationStatus
from whitney.service.store.records import OperationRecord


def _ops(store: Store, n: int) -> list[OperationRecord]:
    session = store.create_session("me")
    ops = []
    for i in range(n):
        run = store.create_run(session.id, "me", "fake", {"rank": 4}, None, False, None)
        op, _ = store.submit_operation("me", run.id, 0, "optim_step", digest({"i": i}))
        ops.append(op)
    return ops


def test_set_operations_moves_many_in_one_transaction(tmp_path):
    ended = []
    store = Store(f"sqlite:///{tmp_path / 's.db'}", observer=lambda *a: ended.append(a))
    ops = _ops(store, 4)
    store.cancel_queued(ops[3].run_id, "gone")  # ended already: it must not move again
    ended.clear()
    hooked = []
    store.at_end[ops[0].id] = lambda status, result: hooked.append(status) or {**result, "hooked": True}
    commits = []
    event.listen(store.engine, "commit", lambda conn: commits.append(1))

    moved = store.set_operations([(op.id, OperationStatus.RUNNING, None, None) for op in ops])
    assert moved == [True, True, True, False] and len(commits) == 1
    moved = store.set_operations([(ops[0].id, OperationStatus.SUCCEEDED, {"metrics": {}}, None),
                                  (ops[1].id, OperationStatus.FAILED, None, {"code": "x", "message": "m"}),
                                  (ops[2].id, OperationStatus.QUEUED, None, None),  # no such move
                                  (ops[3].id, OperationStatus.SUCCEEDED, {}, None)])
    assert moved == [True, True, False, False] and len(commits) == 2
    got = [store.get_operation(op.id) for op in ops]
    assert [g.status for g in got] == ["succeeded", "failed", "running", "cancelled"]
    assert got[0].result == {"metrics": {}, "hooked": True} and hooked == [OperationStatus.SUCCEEDED]
    assert got[1].error == {"code": "x", "message": "m"} and got[0].started_at is not None
    assert [(e[0], e[1]) for e in ended] == [("optim_step", "succeeded"), ("optim_step", "failed")]  # observed once


class Recording(FakeBackend):
    """The fake, recording each optim_steps call, and training calls taking `seconds` each."""

    def __init__(self, seconds: float = 0.0):
        super().__init__()
        self.seconds = seconds
        self.batches: list[list[str]] = []

    def optim_steps(self, steps):
        self.batches.append([run_id for run_id, _ in steps])
        return super().optim_steps(steps)

    def run_batch(self, requests, backward):
        time.sleep(self.seconds)  # the point: a training call that takes this long, timed by the scheduler
        return super().run_batch(requests, backward)


def _scheduler(tmp_path, backend: FakeBackend):
    store, scheduler, open_run, submit = scheduler_over(backend, tmp_path, max_batch_tokens=1000)
    scheduler.start()
    return store, scheduler, open_run, submit


def test_ready_optim_steps_of_many_runs_are_one_backend_call(tmp_path):
    backend = Recording()
    store, scheduler, open_run, submit = _scheduler(tmp_path, backend)
    try:
        runs = [f"r{i}" for i in range(5)]
        for r in runs:
            open_run(r)
        gate = threading.Event()
        scheduler.call(gate.wait)  # holds the worker until every operation is queued
        ops = []
        for i, r in enumerate(runs):
            ops.append(submit(r, 0, "forward_backward", fb(i + 1)))
            ops.append(submit(r, 1, "optim_step", OptimJob(AdamParams(learning_rate=1e-3 * (i + 1)))))
        gate.set()
        got = [wait(store, op) for op in ops]
        assert [g.status for g in got] == ["succeeded"] * 10
        assert backend.batches == [runs]  # the five steps in one call
        # Each run's own result: its gradient was its own tokens.
        assert [g.result["metrics"]["grad_norm"] for g in got[1::2]] == [1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        scheduler.stop()


def test_a_short_sample_is_not_held_one_step_per_training_call(tmp_path):
    """An 8-token sample while training calls of 0.2 s keep coming: it ends within about two of them (it
    gets as much time as the last one), not after eight (one decode step per training call)."""
    backend = Recording(seconds=0.2)
    store, scheduler, open_run, submit = _scheduler(tmp_path, backend)
    try:
        open_run("r")
        training = [submit("r", s, "forward_backward", fb(3)) for s in range(30)]
        deadline = time.monotonic() + 30
        while not any(c[0] == "run_batch" for c in backend.calls):  # training has begun
            assert time.monotonic() < deadline, "no training call began"
            time.sleep(0.01)
        op, _ = store.submit_operation("me", None, None, "sample", "")
        calls_before = sum(c[0] == "run_batch" for c in backend.calls)
        scheduler.submit_sample(op, [1, 2, 3], SamplingParams(max_tokens=8), Weights(base_model="fake"))
        assert wait(store, op).status == "succeeded"
        assert len(store.get_operation(op.id).result["sequences"][0]["tokens"]) == 8
        assert sum(c[0] == "run_batch" for c in backend.calls) - calls_before <= 3
        assert store.get_operation(training[-1].id).status != "succeeded"  # training was still going on
    finally:
        scheduler.stop()
