"""The scheduler without HTTP: a real engine on the tiny model, a real SQLite store, the worker on a thread.

Fairness: a forward_backward larger than the worker's token budget runs as micro-batches, other runs'
operations run between them, and the result (loss, metrics, log-probs, gradient) equals one pass.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tests.models import VOCAB
from whitney.backends.in_process import InProcessBackend
from whitney.engine import AdamParams, Datum, Engine, LoraConfig
from whitney.protocol.backend import Weights
from whitney.service.scheduling.jobs import ForwardJob, OptimJob
from whitney.service.scheduling.limits import plan_micro_batches
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.store.database import Store, digest
from whitney.service.store.records import OperationRecord

TERMINAL = ("succeeded", "failed", "cancelled")


# ---- the plan -------------------------------------------------------------------------------


@pytest.mark.parametrize("remaining,budget,credit,want,credit_after", [
    ([[10, 10], [5]], 100, [0, 0], [2, 1], [0, 0]),  # everything fits: all whole
    ([[100] * 10], 250, [0], [2], [50]),  # alone: the longest prefix within the budget, the rest kept
    ([[300]], 250, [0], [1], [0]),  # alone and one datum over the budget: it still runs
    ([[8] * 4] * 3 + [[60] * 20], 200, [0] * 4, [4, 4, 4, 1], [0, 0, 0, 44]),  # small ones whole, the rest to the big one
    ([[60] * 20, [60] * 20], 200, [0, 0], [1, 2], [40, 20]),  # two big ones share: what one leaves, the next takes
    ([[30] * 5, [300]], 100, [0, 0], [1, 0], [20, 50]),  # a datum over its share waits, earning an equal share...
    ([[30] * 5, [300]], 100, [0, 250], [1, 0], [20, 300]),  # ...until its credit alone pays for it...
    ([[30] * 5, [300]], 100, [0, 300], [1, 1], [20, 0]),  # ...then it runs, past the budget by that datum
    ([[4] * 5], 10, [2], [2], [2]),  # a credit never grows a call past the budget
    ([[300], [400]], 100, [0, 0], [1, 0], [0, 50]),  # nothing affordable: the nearest runs, the engine never idles
])
def test_plan_micro_batches(remaining, budget, credit, want, credit_after):
    assert plan_micro_batches(remaining, budget, credit) == (want, credit_after)


@pytest.mark.parametrize("remaining,reserved,want", [
    ([[60] * 20], [], [3]),  # alone: the whole budget (200)
    ([[60] * 20], [8, 8], [3]),  # small reservations leave most of it
    ([[60] * 20], [100, 100], [1]),  # two runs due back with 100 tokens each: a third share
    ([[60] * 20], [200] * 31, [1]),  # nothing left: one datum (alone among the ready), never zero
    ([[10] * 3, [60] * 20], [150], [3, 1]),  # a ready small one runs whole; the reservation shrinks the big one
])
def test_plan_reserves_the_share_of_runs_due_back(remaining, reserved, want):
    assert plan_micro_batches(remaining, 200, reserved=reserved)[0] == want


def test_plan_is_max_min_fair():
    """However many small operations there are, each of them runs whole while a large one is split."""
    for n_small in (1, 5, 31):
        remaining = [[64] * 4 for _ in range(n_small)] + [[2048] * 64]
        counts, _ = plan_micro_batches(remaining, 16384)
        assert counts[:n_small] == [4] * n_small
        assert 1 <= counts[-1] < 64
        assert sum(sum(r[:c]) for r, c in zip(remaining, counts)) <= 16384


def test_plan_shares_work_not_turns():
    """31 runs of 4 x 64 tokens each call, and one whose datums cost 4000 each (a custom loss's graph work as
    positions' worth): over many calls the costly run gets about an equal share of the work, not a datum every
    other call (which would be 7.8x the others' work each)."""
    budget, calls = 8192, 400
    big, credit, work = [4000] * 1000, [0] * 32, [0] * 32
    for _ in range(calls):
        remaining = [[64] * 4 for _ in range(31)] + [big]
        counts, credit = plan_micro_batches(remaining, budget, credit)
        for i, (r, c) in enumerate(zip(remaining, counts)):
            work[i] += sum(r[:c])
        big = big[counts[-1]:]
    small = sum(work[:31]) / 31
    assert small == 256 * calls  # every small run ran whole every call
    assert 0.8 <= work[-1] / small <= 1.2, work[-1] / small


# ---- the worker ------------------------------------------------------------------------------


@pytest.fixture
def worker(tmp_path, tiny_llama):
    """A scheduler with a budget of 64 tokens per engine call, and a helper to submit operations."""
    engine = Engine()
    engine.load_model(tiny_llama)
    store = Store(f"sqlite:///{tmp_path / 'w.db'}")
    scheduler = Scheduler(InProcessBackend(engine), store, tmp_path, max_batch_tokens=64)
    scheduler.start()
    session = store.create_session("me")

    def open_run(run_id: str, seed: int) -> None:
        lora = dataclasses.asdict(LoraConfig(rank=4, seed=seed))
        scheduler.open_run(run_id, tiny_llama, lora).result(timeout=60)
        store.create_run(session.id, "me", tiny_llama, {}, None, False, None, run_id=run_id)

    def submit(run_id: str, seq_id: int, kind: str, job) -> OperationRecord:
        op, _ = store.submit_operation("me", run_id, seq_id, kind, digest({"seq": seq_id, "run": run_id}))
        scheduler.submit(op, job)
        return op

    yield scheduler, open_run, submit
    scheduler.stop()


def wait(store: Store, op_id: str, timeout: float = 120.0) -> OperationRecord:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        op = store.get_operation(op_id)
        if op.status in TERMINAL:
            return op
        time.sleep(0.01)
    raise AssertionError(f"operation {op_id} did not end")


def datums(seed: int, lengths: list[int]) -> list[Datum]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        s = torch.randint(0, VOCAB, (n + 1,), generator=g).tolist()
        out.append(Datum(s[:-1], {"target_tokens": s[1:], "weights": torch.rand(n, generator=g).tolist()}))
    return out


def fb_payload(data: list[Datum], loss_fn: str = "cross_entropy") -> ForwardJob:
    return ForwardJob(data, loss_fn, {}, [len(d.token_ids) for d in data])


def test_large_operation_runs_in_micro_batches_equal_to_one_pass(worker, tiny_llama):
    scheduler, open_run, submit = worker
    store, engine = scheduler.store, scheduler.backend.engine
    open_run("big", seed=1)
    open_run("small", seed=2)
    data = datums(0, [20] * 12)  # 240 tokens: at least 4 engine calls of 64
    calls = []
    real = engine.run_batch
    engine.run_batch = lambda requests, backward: calls.append([(r.run_id, len(r.data)) for r in requests]) \
        or real(requests, backward)
    big = submit("big", 0, "forward_backward", fb_payload(data))
    small = [submit("small", i, "forward_backward", fb_payload(datums(10 + i, [6]))) for i in range(3)]
    big_done = wait(store, big.id)
    small_done = [wait(store, op.id) for op in small]

    assert big_done.status == "succeeded", big_done.error
    assert all(op.status == "succeeded" for op in small_done)
    big_calls = [n for call in calls for run, n in call if run == "big"]
    assert sum(big_calls) == 12 and len(big_calls) >= 4 and max(big_calls) <= 3
    # The small run's operations did not wait for the whole large one.
    assert small_done[0].finished_at < big_done.finished_at
    # Equal to one pass: a fresh engine, the same run, the whole batch at once.
    reference = Engine()
    reference.models.update(engine.models)
    reference.create_run("big", tiny_llama, LoraConfig(rank=4, seed=1))
    want = reference.forward_backward("big", data)
    got = big_done.result
    assert got["loss"] == pytest.approx(want.loss, rel=1e-5)
    assert got["metrics"] == pytest.approx(want.metrics, rel=1e-5)
    for o, w in zip(got["outputs"], want.outputs):
        torch.testing.assert_close(torch.tensor(o["logprobs"]), torch.tensor(w.logprobs), rtol=1e-5, atol=1e-6)
    got_grads, want_grads = engine.runs["big"].grads, reference.runs["big"].grads
    assert got_grads.keys() == want_grads.keys() and not engine.runs["big"].staged
    flat_got = torch.cat([got_grads[k].flatten() for k in want_grads]).double()
    flat_want = torch.cat([want_grads[k].flatten() for k in want_grads]).double()
    assert float(flat_want.norm()) > 0
    assert float((flat_got - flat_want).norm() / flat_want.norm()) < 1e-5
    scale = float(flat_want.abs().max())
    for k in want_grads:
        torch.testing.assert_close(got_grads[k], want_grads[k], rtol=1e-5, atol=1e-5 * scale)


def test_failed_micro_batch_adds_no_gradient_and_names_the_whole_operations_datum(worker):
    scheduler, open_run, submit = worker
    open_run("r", seed=3)
    data = datums(1, [20] * 6)
    data[4].loss_inputs["target_tokens"] = data[4].loss_inputs["target_tokens"][:-1]  # refused by the engine
    op = wait(scheduler.store, submit("r", 0, "forward_backward", fb_payload(data)).id)
    assert op.status == "failed" and op.error["datum_index"] == 4, op.error
    assert op.error["category"] == "user"
    assert not scheduler.backend.engine.runs["r"].grads and not scheduler.backend.engine.runs["r"].staged


def test_cancel_during_micro_batches(worker):
    scheduler, open_run, submit = worker
    open_run("r", seed=4)
    op = submit("r", 0, "forward_backward", fb_payload(datums(2, [30] * 40)))  # 20 engine calls
    after = submit("r", 1, "optim_step", OptimJob(AdamParams()))
    deadline = time.monotonic() + 60
    while scheduler.store.get_operation(op.id).status != "running" and time.monotonic() < deadline:
        time.sleep(0.005)
    scheduler.cancel_run("r", "cancelled by the test")
    assert wait(scheduler.store, op.id, timeout=30).status == "cancelled"
    assert wait(scheduler.store, after.id, timeout=30).status == "cancelled"


def test_compute_logprobs_in_chunks_equals_one_call(worker, tiny_llama):
    scheduler, _, _ = worker
    store = scheduler.store
    g = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (30, 1, 45, 12, 50, 7)]
    op, _ = store.submit_operation("me", None, None, "compute_logprobs", "")
    scheduler.submit_logprobs(op, sequences, Weights(base_model=tiny_llama))
    got = wait(store, op.id).result["logprobs"]
    want = scheduler.call(lambda: scheduler.backend.engine.compute_logprobs(sequences, base_model=tiny_llama)).result(60)
    assert [len(x) for x in got] == [len(s) for s in sequences]
    for a, b in zip(got, want):
        assert a[0] is None and b[0] is None
        torch.testing.assert_close(torch.tensor(a[1:]), torch.tensor(b[1:]), rtol=1e-5, atol=1e-6)
