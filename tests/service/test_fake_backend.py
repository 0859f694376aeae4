"""The scheduler driven by a small fake backend (no torch, no model): the Backend protocol is all it needs.

The fake answers every call with numbers derived from its input (a forward's loss is its token count, a
run's gradient the tokens it has seen), records the calls it gets, and fails on demand, so each test
checks one rule of the scheduler: seq_id order, cross-run batches, micro-batches and staged gradients,
sampling by request id with failures isolated, a backend bug answered as a server error.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest

from whitney.backends.in_process import InProcessBackend
from whitney.engine import AdamParams, Datum, DatumOutput, ForwardResult
from whitney.errors import InvalidInput, NotFound
from whitney.protocol.backend import Backend, Failure, ModelInfo, PackageKind, Residency, ServedBackend, Weights
from whitney.protocol.config import EngineConfig
from whitney.protocol.sampling import SampledSequence, SampleProgress, SampleResult, SamplingParams
from whitney.protocol.training import Checked
from whitney.service.scheduling.jobs import ForwardJob, OptimJob, SaveJob
from whitney.service.scheduling.scheduler import Scheduler
from whitney.service.store.database import Store, digest
from whitney.service.store.records import OperationRecord

TERMINAL = ("succeeded", "failed", "cancelled")
POISON = 666  # a prompt or datum token the fake refuses


@dataclass
class FakeBackend:
    """Backend over plain Python: loss = tokens, gradient = tokens seen, one sampled token per step."""

    config: EngineConfig = field(default_factory=EngineConfig)
    calls: list[tuple] = field(default_factory=list)
    grads: dict[str, float] = field(default_factory=dict)
    staged: dict[tuple[str, str], float] = field(default_factory=dict)
    samples: dict[str, list] = field(default_factory=dict)  # request id -> [prompt, params, tokens]
    broken: bool = False  # run_batch raises (a backend bug)
    broken_commits: set[str] = field(default_factory=set)  # runs whose staged gradient settle_gradients cannot keep
    lost: list[str] = field(default_factory=list)  # runs take_lost_runs reports next
    separate_sampling: bool = False

    @property
    def models(self) -> dict[str, ModelInfo]:
        return {"fake": ModelInfo("fake", "fake", 100, 64, ("q_proj",), "float32", "cpu", (2,))}

    def losses(self) -> dict:
        return {"cross_entropy": {"required_inputs": ["target_tokens"], "optional_inputs": ["weights"], "config": {},
                                  "passes": [], "tinker_defaults": {}}}

    def check_custom_loss(self, definition) -> None:
        raise InvalidInput("the fake backend runs no custom losses", field="graph")

    def adapter_bytes(self, base_model, lora) -> int:
        return 16 * lora.rank

    def validate(self, request, backward) -> Checked:
        return Checked([len(d.token_ids) for d in request.data], [len(d.token_ids) for d in request.data])

    def image_tokens(self, base_model, chunks) -> list[int]:
        raise InvalidInput("the fake backend's models take no images", field="chunks")

    def create_run(self, run_id, base_model, lora, resume_path=None, resume_with_optimizer=False) -> None:
        self.calls.append(("create_run", run_id))
        self.grads[run_id] = 0.0

    def delete_run(self, run_id) -> None:
        self.calls.append(("delete_run", run_id))
        self.grads.pop(run_id, None)

    def run_batch(self, requests, backward):
        self.calls.append(("run_batch", [(r.run_id, len(r.data), r.stage) for r in requests], backward))
        if self.broken:
            raise RuntimeError("the fake backend is broken")
        out = []
        for r in requests:
            if r.run_id not in self.grads:
                out.append(Failure.of(NotFound(f"run {r.run_id!r} does not exist", field="run_id")))
                continue
            bad = [i for i, d in enumerate(r.data) if POISON in d.token_ids]
            if bad:
                out.append(Failure.of(InvalidInput("poison", field="token_ids", datum_index=bad[0])))
                continue
            tokens = float(sum(len(d.token_ids) for d in r.data))
            if backward and r.stage is None:
                self.grads[r.run_id] += tokens
            elif backward:
                self.staged[(r.run_id, r.stage)] = self.staged.get((r.run_id, r.stage), 0.0) + tokens
            outputs = [DatumOutput([-1.0] * len(d.token_ids), [1.0] * len(d.token_ids)) for d in r.data]
            out.append(ForwardResult(tokens, {"loss:sum": tokens, "tokens:sum": tokens}, outputs))
        return out

    def settle_gradients(self, run_id, stage, keep) -> None:
        self.calls.append(("commit" if keep else "discard", run_id, stage))
        if keep and run_id in self.broken_commits:
            raise RuntimeError(f"the fake cannot commit {run_id}'s gradient")
        staged = self.staged.pop((run_id, stage), 0.0)
        if keep:
            self.grads[run_id] += staged

    def optim_steps(self, steps):
        out = []
        for run_id, _ in steps:
            self.calls.append(("optim_step", run_id))
            norm, self.grads[run_id] = self.grads[run_id], 0.0
            out.append({"grad_norm": norm})
        return out

    def save(self, run_id, kind, path, include_optimizer=True) -> int | None:
        Path(path).mkdir(parents=True)
        if kind in (PackageKind.STATE, PackageKind.SAMPLER):
            (Path(path) / "state").write_text(f"{self.grads[run_id]}")
        return 1 if kind == PackageKind.SAMPLER else None

    def load_state(self, run_id, path, with_optimizer=False) -> None:
        self.grads[run_id] = float((Path(path) / "state").read_text())

    def compute_logprobs(self, sequences, weights):
        return [[None] + [-1.0] * (len(s) - 1) for s in sequences]

    def submit_sample(self, request_id, prompt, params, weights, stream=False) -> None:
        self.samples[request_id] = [prompt, params, [], stream]

    def sample_step(self):
        ended = []
        for request_id, (prompt, params, tokens, stream) in list(self.samples.items()):
            if POISON in prompt:
                ended.append((request_id, Failure.of(InvalidInput("poison prompt", field="prompt"))))
            else:
                tokens.append(len(tokens))
                if len(tokens) < params.max_tokens:
                    if stream:
                        ended.append((request_id, SampleProgress([[tokens[-1]]], [[-1.0]])))
                    continue
                ended.append((request_id, SampleResult([SampledSequence(tokens, [-1.0] * len(tokens), "length")])))
            del self.samples[request_id]
        return ended

    def cancel_sample(self, request_id) -> None:
        self.calls.append(("cancel_sample", request_id))
        self.samples.pop(request_id, None)

    def take_lost_runs(self) -> list[str]:
        lost, self.lost = self.lost, []
        return lost

    def adopt(self) -> list[str]:
        return list(self.grads)  # the runs it holds

    def page_out_idle(self) -> int:
        return 0  # holds no memory worth paging

    def residency(self) -> Residency:
        return Residency(in_memory=len(self.grads))

    def render_chat(self, base_model, messages, add_generation_prompt=True, mark_assistant=False):
        raise InvalidInput("the fake model has no chat template", field="messages")

    def encode(self, base_model, text) -> list[int]:
        return [len(word) for word in text.split()]

    def decode(self, base_model, sequences, skip_special_tokens=True) -> list[str]:
        return [" ".join(map(str, s)) for s in sequences]

    @property
    def sampling_in_flight(self) -> int:
        return len(self.samples)

    def close(self) -> None:
        pass


@pytest.fixture(params=[False, True], ids=["one-thread", "sampling-apart"])
def fake(tmp_path, request):
    """The scheduler over the fake: sampling on the training thread, and on its own (`separate_sampling`)."""
    backend = FakeBackend(separate_sampling=request.param)
    _, scheduler, open_run, submit = scheduler_over(backend, tmp_path, max_batch_tokens=10)
    scheduler.start()
    yield backend, scheduler, open_run, submit
    scheduler.stop()


def scheduler_over(backend, tmp_path, max_batch_tokens: int):
    """A scheduler (not started) over `backend` with a fresh SQLite store; (store, scheduler, open_run, submit)."""
    store = Store(f"sqlite:///{tmp_path / 'f.db'}")
    scheduler = Scheduler(backend, store, tmp_path, max_batch_tokens=max_batch_tokens)
    session = store.create_session("me")

    def open_run(run_id: str) -> None:
        scheduler.open_run(run_id, "fake", {"rank": 4}).result(timeout=10)
        store.create_run(session.id, "me", "fake", {"rank": 4}, None, False, None, run_id=run_id)

    def submit(run_id: str, seq_id: int, kind: str, job) -> OperationRecord:
        op, _ = store.submit_operation("me", run_id, seq_id, kind, digest({"run": run_id, "seq": seq_id}))
        scheduler.submit(op, job)
        return op

    return store, scheduler, open_run, submit


def fb(*lengths: int, token: int = 1) -> ForwardJob:
    return ForwardJob([Datum([token] * n, {"target_tokens": [1] * n}) for n in lengths], "cross_entropy", {},
                      list(lengths))


def wait(store: Store, op: OperationRecord) -> OperationRecord:
    deadline = time.monotonic() + 20
    while (got := store.get_operation(op.id)).status not in TERMINAL:
        assert time.monotonic() < deadline, f"{op.kind} never ended"
        time.sleep(0.005)
    return got


def test_both_backends_implement_the_protocol(tiny_llama):
    from whitney.engine import Engine

    assert isinstance(FakeBackend(), ServedBackend)
    assert isinstance(InProcessBackend(Engine()), ServedBackend)
    # What operations call stays narrow: housekeeping and tokenizers are interfaces of their own.
    methods = [name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")]
    assert len(methods) == 16 and "models" in vars(Backend), methods


def test_seq_id_order_and_cross_run_batches(fake):
    backend, scheduler, open_run, submit = fake
    open_run("a")
    open_run("b")
    with scheduler._lock:  # hold the worker's view still while everything is queued, latest seq_id first
        ops = [submit("a", 2, "optim_step", OptimJob(AdamParams())), submit("a", 1, "forward_backward", fb(2)),
               submit("a", 0, "forward_backward", fb(3)), submit("b", 0, "forward_backward", fb(4))]
    done = [wait(scheduler.store, op) for op in ops]
    assert [op.status for op in done] == ["succeeded"] * 4
    batches = [c[1] for c in backend.calls if c[0] == "run_batch"]
    assert sorted(batches[0]) == [("a", 1, None), ("b", 1, None)], "seq 0 of both runs in one call"
    assert batches[1] == [("a", 1, None)]
    assert done[0].result["metrics"]["grad_norm"] == 5.0  # optim_step saw both of a's operations
    assert done[2].result["loss"] == 3.0 and done[3].result["loss"] == 4.0


def test_an_optim_step_behind_a_forward_backward_runs_before_the_next_engine_call(fake):
    """The optim_step a client submits behind its forward_backward becomes ready when that engine call ends;
    it runs right then, not after the next engine call (another run's forward_backward that became ready too)."""
    backend, scheduler, open_run, submit = fake
    open_run("a")
    open_run("b")
    with scheduler._lock:
        ops = [submit("a", 0, "forward_backward", fb(2)), submit("a", 1, "optim_step", OptimJob(AdamParams())),
               submit("b", 0, "forward_backward", fb(3)), submit("b", 1, "forward_backward", fb(4))]
    assert [wait(scheduler.store, op).status for op in ops] == ["succeeded"] * 4
    order = [c[0] if c[0] != "run_batch" else sorted(r for r, *_ in c[1]) for c in backend.calls
             if c[0] in ("run_batch", "optim_step")]
    assert order == [["a", "b"], "optim_step", ["b"]], order


def test_an_engine_calls_ends_are_stored_with_the_optim_steps_it_made_ready(fake, monkeypatch):
    """The forward_backward's end is held while the optim_step behind it runs (its client, woken, would send
    its next requests meanwhile), then both are stored in one transaction, each with its own end time."""
    backend, scheduler, open_run, submit = fake
    open_run("a")
    seen = []
    steps = backend.optim_steps
    monkeypatch.setattr(backend, "optim_steps", lambda s: (seen.append(scheduler.store.get_operation(ops[0].id)),
                                                           steps(s))[1])
    with scheduler._lock:
        ops = [submit("a", 0, "forward_backward", fb(2)), submit("a", 1, "optim_step", OptimJob(AdamParams()))]
    done = [wait(scheduler.store, op) for op in ops]
    assert [op.status for op in done] == ["succeeded"] * 2
    assert [op.status for op in seen] == ["running"], "the forward_backward's end waited for the optim_step"
    assert done[0].started_at <= done[0].finished_at <= done[1].started_at <= done[1].finished_at


def test_large_operation_in_micro_batches_with_a_staged_gradient(fake):
    backend, scheduler, open_run, submit = fake
    open_run("a")
    op = wait(scheduler.store, submit("a", 0, "forward_backward", fb(4, 4, 4, 4, 4)))  # 20 tokens, budget 10
    assert op.status == "succeeded" and op.result["loss"] == 20.0
    assert op.result["metrics"] == {"loss:sum": 20.0, "tokens:sum": 20.0}
    assert len(op.result["outputs"]) == 5
    parts = [c[1][0] for c in backend.calls if c[0] == "run_batch"]
    assert [n for _, n, _ in parts] == [2, 2, 1] and all(stage == op.id for _, _, stage in parts)
    assert ("commit", "a", op.id) in backend.calls and backend.grads["a"] == 20.0


def test_a_costly_operation_is_shared_out_by_its_cost_not_its_tokens(fake):
    """A custom loss's graph work makes its datums cost more than their tokens (Checked.cost_D): the engine is shared
    out by cost, so 4 one-token datums costing 5 each run as micro-batches (budget 10), another run's cheap
    operation beside the first; by their tokens alone they would have run in one call."""
    backend, scheduler, open_run, submit = fake
    open_run("a")
    open_run("b")
    costly = replace(fb(1, 1, 1, 1), costs=[5, 5, 5, 5])
    with scheduler._lock:
        ops = [submit("a", 0, "forward_backward", costly), submit("b", 0, "forward_backward", fb(2))]
    done = [wait(scheduler.store, op) for op in ops]
    assert [op.status for op in done] == ["succeeded"] * 2 and done[0].result["loss"] == 4.0
    calls = [sorted((run, n) for run, n, _ in c[1]) for c in backend.calls if c[0] == "run_batch"]
    assert calls[0] == [("a", 1), ("b", 1)], calls  # a's share of the budget (10 / 2) holds one of its datums
    assert sum(n for c in calls for run, n in c if run == "a") == 4 and len(calls) >= 3, calls


def test_a_refused_micro_batch_discards_and_names_the_datum(fake):
    backend, scheduler, open_run, submit = fake
    open_run("a")
    job = fb(4, 4, 4, 4)
    job.data[3].token_ids[0] = 666  # refused in the second micro-batch, as datum 1 of it
    op = wait(scheduler.store, submit("a", 0, "forward_backward", job))
    assert op.status == "failed" and op.error["datum_index"] == 3 and op.error["category"] == "user"
    assert ("discard", "a", op.id) in backend.calls and backend.grads["a"] == 0.0 and not backend.staged


def test_sampling_by_request_id_with_one_failure(fake):
    backend, scheduler, _, _ = fake
    store = scheduler.store
    ops = []
    for prompt in ([1, 2], [POISON], [3]):
        op, _ = store.submit_operation("me", None, None, "sample", "")
        scheduler.submit_sample(op, prompt, SamplingParams(max_tokens=3), Weights(base_model="fake"))
        ops.append(op)
    good, bad, other = (wait(store, op) for op in ops)
    assert bad.status == "failed" and bad.error["field"] == "prompt"
    for op in (good, other):
        assert op.status == "succeeded" and op.result["sequences"][0]["tokens"] == [0, 1, 2]


def test_a_streaming_sample_reports_each_token_before_it_ends(fake):
    """The listener gets every token chosen before the end, in order, and then the end (the result stored)."""
    import asyncio

    backend, scheduler, _, _ = fake
    op, _ = scheduler.store.submit_operation("me", None, None, "sample", "")
    listener = scheduler.submit_sample(op, [1], SamplingParams(max_tokens=5), Weights(base_model="fake"), stream=True)

    async def drain() -> list[int]:
        seen = []
        while True:
            reports, ended = await listener.get(timeout=5)
            for report in reports:
                seen += report.tokens[0]
            if ended:
                return seen

    assert asyncio.run(drain()) == [0, 1, 2, 3]  # the fifth ends the request: it is in the result only
    assert wait(scheduler.store, op).result["sequences"][0]["tokens"] == [0, 1, 2, 3, 4]
    assert op.id not in scheduler.ends.streams


def test_a_cancelled_sample_leaves_the_backend_and_ends_cancelled(fake):
    """Issue 31: cancel_sample drops the request from the backend between two steps (it never decodes again) and
    ends its operation cancelled, its listener told; another sample goes on; a sample that ended is left as it is."""
    import asyncio

    backend, scheduler, _, _ = fake
    store = scheduler.store
    long, _ = store.submit_operation("me", None, None, "sample", "")
    short, _ = store.submit_operation("me", None, None, "sample", "")
    listener = scheduler.submit_sample(long, [1], SamplingParams(max_tokens=10**9), Weights(base_model="fake"),
                                       stream=True)
    scheduler.submit_sample(short, [1], SamplingParams(max_tokens=50), Weights(base_model="fake"))

    async def first_tokens() -> None:
        while not (await listener.get(timeout=5))[0]:
            pass

    asyncio.run(first_tokens())  # it decodes
    assert scheduler.cancel_sample(long.id, "gone").result(timeout=10) is True
    assert ("cancel_sample", long.id) in backend.calls and long.id not in backend.samples
    cancelled = wait(store, long)
    assert cancelled.status == "cancelled" and cancelled.error == {"code": "cancelled", "message": "gone"}
    assert asyncio.run(listener.get(timeout=5))[1], "the stream's listener is told it ended"
    assert wait(store, short).status == "succeeded"
    assert scheduler.cancel_sample(short.id).result(timeout=10) is False  # ended first: unchanged
    assert store.get_operation(short.id).status == "succeeded"


def test_a_backend_bug_is_a_server_error_and_the_worker_goes_on(fake):
    backend, scheduler, open_run, submit = fake
    open_run("a")
    backend.broken = True
    op = wait(scheduler.store, submit("a", 0, "forward_backward", fb(2)))
    assert op.status == "failed" and op.error["category"] == "server" and op.error["code"] == "internal"
    backend.broken = False
    assert wait(scheduler.store, submit("a", 1, "forward_backward", fb(2))).status == "succeeded"
    saved = wait(scheduler.store, submit("a", 2, "save_state", SaveJob("s")))
    assert saved.status == "succeeded" and saved.result["package"]["name"] == "s"


def test_a_bug_while_ending_one_operation_fails_it_alone_and_the_worker_goes_on(fake):
    """An error after the engine call (committing a staged gradient here) ends that operation as a server error;
    the other run's operation in the same call succeeds, and both runs go on (nothing is left running)."""
    backend, scheduler, open_run, submit = fake
    open_run("a")
    open_run("b")
    backend.broken_commits.add("a")
    bad = submit("a", 0, "forward_backward", fb(4, 4, 4))  # 12 tokens, budget 10: staged, then committed
    good = submit("b", 0, "forward_backward", fb(2))
    bad, good = wait(scheduler.store, bad), wait(scheduler.store, good)
    assert bad.status == "failed" and bad.error["category"] == "server", bad
    assert good.status == "succeeded" and backend.grads["b"] == 2.0
    assert ("discard", "a", bad.id) in backend.calls and not backend.staged, "the staged gradient is dropped"
    backend.broken_commits.clear()
    assert wait(scheduler.store, submit("a", 1, "forward_backward", fb(2))).status == "succeeded"
    assert backend.grads["a"] == 2.0


def test_sampling_apart_runs_on_its_own_thread(fake):
    backend, scheduler, _, _ = fake
    threads = {t.name for t in scheduler._threads}
    assert threads == ({"whitney-worker", "whitney-sampler"} if backend.separate_sampling else {"whitney-worker"})


def test_a_lost_run_is_interrupted_and_its_waiting_operations_fail(fake):
    backend, scheduler, open_run, submit = fake
    store = scheduler.store
    open_run("a")
    open_run("b")
    with scheduler._lock:  # a's seq_id 1 waits behind the missing 0 when its worker is reported lost
        waiting = submit("a", 1, "optim_step", OptimJob(AdamParams()))
        backend.lost.append("a")
    failed = wait(store, waiting)
    assert failed.status == "failed" and failed.error["code"] == "worker_lost"
    assert failed.error["category"] == "server"
    deadline = time.monotonic() + 10
    while store.get_run("a").status != "interrupted":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert "resume" in store.get_run("a").error
    assert wait(store, submit("b", 0, "forward_backward", fb(2))).status == "succeeded", "other runs go on"
