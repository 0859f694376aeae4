"""The scheduler: one worker thread drives the backend; runs' operations go in seq_id order.

Routes record an operation in the store, then hand its typed job here. The worker wakes on an event
(never a sleep loop), picks for every run the operation whose seq_id is next, and sends the ready
forward_backward (or forward) operations of different runs to the backend as one mixed batch of at
most `max_batch_tokens` tokens, shared max-min fairly between the runs (`limits.plan_micro_batches`):
an operation larger than its share runs as several micro-batches, one per engine call, its gradient
staged in the backend until the last one succeeded, with other runs' work in between. Every other
ready optim_step of every run goes in one backend call (`optim_steps`), every other operation runs alone;
a batch's starts are one store statement, a turn's ends one transaction. Between training iterations the
worker decodes until sampling has had as much time as the last training iteration (at least one step; a
sample submitted meanwhile joins at the next step) and scores (compute_logprobs) one chunk, so neither
training nor sampling starves the other. A backend whose sampling runs apart from training
(`separate_sampling`: the Ray backend's sampler workers) gets a second thread for sampling and scoring
instead, so neither waits for the other. Runs the backend lost with a
dying worker are interrupted and their waiting operations fail with `worker_lost`. Each terminal
state is written to the store, then waiters are woken. A streaming sample's new tokens go to its
listener (`SampleStream`) as each sampling step reports them; its end follows the stored result.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Any, Callable

from whitney.protocol.backend import Failure, ServedBackend, Weights
from whitney.protocol.sampling import SampleProgress, SamplingParams
from whitney.protocol.training import ForwardRequest, LoraConfig
from whitney.service.scheduling.jobs import ForwardJob, Job, OptimJob, Refused
from whitney.service.scheduling.limits import plan_micro_batches
from whitney.service.scheduling.queues import (Lane, Progress, RunQueue, SampleStream, Scoring, end_move, end_of_part,
                                               sample_result)
from whitney.service.scheduling.saves import execute
from whitney.service.store.database import Store
from whitney.service.store.lifecycle import (OPERATION_TERMINAL, RUN_OPEN, OperationKind, OperationStatus, RunStatus,
                                             SessionStatus)
from whitney.service.store.packages import reap

log = logging.getLogger("whitney.scheduler")


class Scheduler:
    def __init__(self, backend: ServedBackend, store: Store, data_dir: Path, max_batch_tokens: int = 8192,
                 session_timeout: float = 600.0, recent_seconds: float = 2.0, expiry_interval: float = 5.0):
        self.backend = backend
        self.store = store
        self.data_dir = Path(data_dir)
        self.max_batch_tokens = max_batch_tokens
        # A run that had training work ready within the last two engine calls or this many seconds keeps
        # its share of each call reserved while its next operation is on its way.
        self.recent_seconds = recent_seconds
        self.session_timeout = session_timeout
        self.expiry_interval = expiry_interval  # seconds between passes of the session and checkpoint reaper
        self._runs: dict[str, RunQueue] = {}
        self._samples: dict[str, dict] = {}  # operation id (the backend's request id) -> operation
        self._streams: dict[str, SampleStream] = {}  # streaming samples' listeners, by operation id
        self._scoring: list[Scoring] = []
        self._calls_made = 0  # engine training calls so far (the fairness clock)
        self._training_seconds = 0.0  # the last training iteration's time: sampling's share after it
        self._lock = threading.RLock()  # _finalize notifies waiters while holding it
        self._training = Lane("whitney-worker")
        # Sampling and scoring: on the training thread, or on their own when the backend runs them apart.
        self._sampling = Lane("whitney-sampler") if backend.separate_sampling else self._training
        self._stop = False
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._threads = [threading.Thread(target=self._loop, name=self._training.name, daemon=True)]
        if self._sampling is not self._training:
            self._threads.append(threading.Thread(target=self._sampling_loop, name=self._sampling.name, daemon=True))
        self._last_expiry_check = 0.0

    # ---- from any thread ----------------------------------------------------------------

    def start(self) -> None:
        """Run the worker loop on its own thread (tests, the demo's in-process server)."""
        for thread in self._threads:
            thread.start()

    def run(self) -> None:
        """Run the worker loop on the calling thread until stop(). `whitney serve` runs it on the main
        thread: torch's OpenMP kernels launched from any other thread pay 50-120 us more per call here
        (libgomp keeps no spinning team for them), which halved decode throughput."""
        for thread in self._threads[1:]:
            thread.start()
        self._loop()

    def stop(self) -> None:
        self._stop = True
        for lane in {id(self._training): self._training, id(self._sampling): self._sampling}.values():
            lane.wake.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=30)

    def call(self, fn: Callable[[], Any], lane: Lane | None = None) -> concurrent.futures.Future:
        """Run fn() on a worker thread (the training one by default); the future carries its result."""
        lane = lane or self._training
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            lane.calls.append((fn, future))
        lane.wake.set()
        return future

    def submit(self, operation: dict, job: Job) -> None:
        """Queue a training operation already recorded in the store."""
        with self._lock:
            queue = self._runs.setdefault(operation["run_id"], RunQueue())
            if operation["seq_id"] < queue.next_seq or operation["seq_id"] in queue.pending:
                return  # a retry of an operation already known
            queue.pending[operation["seq_id"]] = (operation, job)
        self._training.wake.set()

    def submit_sample(self, operation: dict, prompt: list[int], params: SamplingParams, weights: Weights,
                      stream: bool = False) -> SampleStream | None:
        """Queue a sampling operation; the backend knows it by the operation's id. With `stream`, the
        tokens reach the returned listener as they are chosen (its end: the operation is terminal)."""
        listener = SampleStream() if stream else None
        if listener is not None:
            with self._lock:
                self._streams[operation["id"]] = listener

        def start() -> None:
            try:
                self.backend.submit_sample(operation["id"], prompt, params, weights, stream=stream)
            except BaseException as e:
                self._finish_all([(operation, None, e)])
                return
            self.store.set_operation(operation["id"], OperationStatus.RUNNING)
            self._samples[operation["id"]] = operation
        self.call(start, self._sampling)
        return listener

    def drop_stream(self, op_id: str) -> None:
        """Nobody listens any more (the client went away): the sample runs on, its reports are dropped."""
        with self._lock:
            self._streams.pop(op_id, None)

    def submit_logprobs(self, operation: dict, sequences: list[list[int]], weights: Weights) -> None:
        """Score sequences on the named weights (not in any run's seq_id order), a chunk per iteration."""
        with self._lock:
            self._scoring.append(Scoring(operation, sequences, weights))
        self._sampling.wake.set()

    def open_run(self, run: dict, resume_path: str | None) -> concurrent.futures.Future:
        """Create the run's adapter in the backend (and load its bound checkpoint)."""
        def create() -> None:
            self.backend.create_run(run["id"], run["base_model"], LoraConfig.from_dict(run["lora"]), resume_path,
                                    run["resume_with_optimizer"])
            with self._lock:
                self._runs.setdefault(run["id"], RunQueue())
        return self.call(create)

    def finish_run(self, run_id: str) -> concurrent.futures.Future:
        """Run what is queued, then mark the run finished (at once when nothing is queued)."""
        def finish() -> None:
            with self._lock:
                queue = self._runs.setdefault(run_id, RunQueue())
                queue.finishing = True
                if queue.next_seq not in queue.pending:
                    self._finalize(run_id, queue)
        return self.call(finish)

    def cancel_run(self, run_id: str, reason: str = "run cancelled") -> None:
        """Cancel queued operations and one part-way through its micro-batches (a single engine call
        that is running ends); then the run is cancelled."""
        with self._lock:
            queue = self._runs.pop(run_id, None)
        if queue is not None and queue.progress is not None and queue.next_seq in queue.pending:
            op = queue.pending[queue.next_seq][0]
            self.store.set_operation(op["id"], OperationStatus.CANCELLED,
                                     error={"code": "cancelled", "message": reason})
            self._notify(op["id"])
        for op_id in self.store.cancel_queued(run_id, reason):
            self._notify(op_id)
        def drop() -> None:
            self.backend.delete_run(run_id)
            self.store.set_run_status(run_id, RunStatus.CANCELLED)
        self.call(drop)

    async def wait(self, op_id: str, timeout: float) -> None:
        """Return when the operation may have become terminal, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiters.setdefault(op_id, []).append((loop, future))
        if self.store.get_operation(op_id)["status"] in OPERATION_TERMINAL:
            return
        try:
            await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            pass
        finally:
            with self._lock:
                waiters = self._waiters.get(op_id, [])
                if (loop, future) in waiters:
                    waiters.remove((loop, future))

    # ---- the worker thread --------------------------------------------------------------

    def _notify(self, op_id: str) -> None:
        with self._lock:
            waiters = self._waiters.pop(op_id, [])
        for loop, future in waiters:
            loop.call_soon_threadsafe(lambda f=future: f.done() or f.set_result(None))

    def _finish_all(self, ends: list[tuple[dict, dict | None, BaseException | Failure | None]],
                    ended_at: list[float | None] | None = None) -> None:
        """Each (operation, result, error) stored in one transaction (`ended_at`: each one's end, if earlier);
        then waiters and listeners woken."""
        if ends:
            self.store.set_operations([end_move(*end) for end in ends], ended_at)
        for operation, _, _ in ends:
            self._notify(operation["id"])
            with self._lock:
                listener = self._streams.pop(operation["id"], None)
            if listener is not None:
                listener.end()

    def _loop(self) -> None:
        """The training thread: calls, lost runs, one training engine call, (sampling and scoring when they
        share this thread), session expiry."""
        steps = [self._interrupt_lost_runs, self._run_training]
        if self._sampling is self._training:
            steps += [self._run_sampling, self._run_scoring]
        # Idle runs paged out (the backend's clock check between calls; engine/paging.py), on this thread.
        self._serve(self._training, [*steps, self._expire_sessions, self.backend.page_out_idle])

    def _sampling_loop(self) -> None:
        """The sampling thread of a backend with `separate_sampling`: its calls, decode steps and scoring."""
        self._serve(self._sampling, [self._run_sampling, self._run_scoring])

    def _serve(self, lane: Lane, steps: list[Callable[[], bool | None]]) -> None:
        """Run the lane's calls and then each step, again and again; sleep until woken when none did anything."""
        while not self._stop:
            lane.wake.clear()
            try:
                did = self._run_calls(lane)
                for step in steps:
                    did |= bool(step())
            except Exception:  # a bug: log it and keep serving the other runs
                log.exception("%s iteration failed", lane.name)
                did = False
            if not did:
                lane.wake.wait(timeout=1.0)

    def _run_calls(self, lane: Lane) -> bool:
        with self._lock:
            calls, lane.calls = lane.calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)
        return bool(calls)

    def _interrupt_lost_runs(self) -> bool:
        """Runs whose worker died (their adapter and optimizer state with it): each is interrupted, and its
        operation part-way through micro-batches and its queued ones fail with worker_lost."""
        lost = self.backend.take_lost_runs()
        for run_id in lost:
            message = (f"run {run_id} was lost with its worker (the process died); it is interrupted: resume from "
                       "its newest saved state with a new run")
            error = {"code": "worker_lost", "message": message, "category": "server"}
            with self._lock:
                queue = self._runs.pop(run_id, None)
            if queue is not None and queue.progress is not None and queue.next_seq in queue.pending:
                op = queue.pending[queue.next_seq][0]
                self.store.set_operation(op["id"], OperationStatus.FAILED, error=error)
                self._notify(op["id"])
            for op_id in self.store.end_queued(run_id, OperationStatus.FAILED, error):
                self._notify(op_id)
            self.store.set_run_status(run_id, RunStatus.INTERRUPTED, error=message)
            log.error(message)
        return bool(lost)

    def _ready(self) -> list[tuple[RunQueue, dict, dict]]:
        """For each run, its next operation if it has arrived; finish runs that are drained."""
        ready = []
        with self._lock:
            for run_id, queue in list(self._runs.items()):
                if queue.next_seq in queue.pending:
                    ready.append((queue, *queue.pending[queue.next_seq]))
                elif queue.finishing:
                    self._finalize(run_id, queue)
        return ready

    def _finalize(self, run_id: str, queue: RunQueue) -> None:
        """A finishing run is drained: cancel what waits behind a missing seq_id, free its adapter."""
        del self._runs[run_id]
        for seq, (op, _) in queue.pending.items():
            self.store.set_operation(op["id"], OperationStatus.CANCELLED, error={
                "code": "cancelled",
                "message": f"run finished before seq_id {seq} could run (seq_id {queue.next_seq} never arrived)"})
            self._notify(op["id"])
        self.backend.delete_run(run_id)
        self.store.set_run_status(run_id, RunStatus.FINISHED)

    def _advance(self, operation: dict) -> None:
        with self._lock:
            queue = self._runs.get(operation["run_id"])
            if queue is not None and queue.pending.pop(operation["seq_id"], None) is not None:
                queue.next_seq = operation["seq_id"] + 1
                queue.progress = None

    def _run_training(self) -> bool:
        """One engine call of ready forward/forward_backward work (fairly shared), then every ready
        operation of the other kinds, counting those the engine call made ready (the optim_step behind each
        forward_backward goes now, not after the next engine call). All their ends are stored in one
        transaction, each with its own end time: the woken clients' next requests do not slow those
        optim_steps (2-5x under 32 clients on 2 cores). An operation that ended while queued (its run
        cancelled: the store refuses its RUNNING move) is skipped, and its run's order moves on."""
        ready = self._ready()
        if not ready:
            self._training_seconds = 0.0
            return False
        start = time.monotonic()
        batched = [item for item in ready if isinstance(item[2], ForwardJob)]
        held, held_at = [], 0.0
        if batched:
            held, held_at = self._run_batch(batched), time.time()
            ready = self._ready()
        singles = [(op, job) for _, op, job in ready if not isinstance(job, ForwardJob)]
        ends = []  # the engine call's ends are stored even if a bug stops the rest
        try:
            ends = self._run_singles(singles) if singles else []
        finally:
            self._finish_all(held + ends, [held_at] * len(held) + [None] * len(ends))
        for op, _, _ in ends:
            self._advance(op)
        self._training_seconds = time.monotonic() - start
        return True

    def _run_batch(self, ready: list[tuple[RunQueue, dict, ForwardJob]]) -> list[tuple[dict, dict | None, Failure | None]]:
        """One engine call: the least recently served run's kind (forward or forward_backward), and the
        ready operations of that kind, each whole or a micro-batch of it (`plan_micro_batches`). Returns the
        (operation, result, failure) it ended, for the caller to store; their runs' orders moved on."""
        ready.sort(key=lambda item: item[0].served)
        kind = ready[0][1]["kind"]
        items = [item for item in ready if item[1]["kind"] == kind]
        now = time.monotonic()
        remaining = [job.lengths[queue.progress.done if queue.progress else 0:] for queue, _, job in items]
        for queue, _, job in ready:
            queue.active_call, queue.active_at = self._calls_made, now
            queue.active_tokens = min(job.tokens, self.max_batch_tokens)
        with self._lock:
            waiting = {id(q) for q, _, _ in items}
            reserved = [q.active_tokens for q in self._runs.values() if id(q) not in waiting and q.active_tokens
                        and (self._calls_made - q.active_call <= 2 or now - q.active_at <= self.recent_seconds)]
        counts = plan_micro_batches(remaining, self.max_batch_tokens, [q.starved for q, _, _ in items], reserved)
        self._calls_made += 1
        starting = [op["id"] for (queue, op, _), count in zip(items, counts) if count and queue.progress is None]
        moved = dict(zip(starting, self.store.set_operations([(i, OperationStatus.RUNNING, None, None)
                                                              for i in starting]))) if starting else {}
        planned, requests = [], []
        for (queue, op, job), count in zip(items, counts):
            queue.starved = count == 0
            if count == 0:
                continue
            if queue.progress is None:
                if not moved[op["id"]]:  # ended while queued (cancelled): skipped, the order moves on
                    self._advance(op)
                    continue
                queue.progress = Progress(staged=count < len(job.data))
            queue.served = self._calls_made
            start = queue.progress.done
            planned.append((queue, op, job, start, start + count))
            requests.append(ForwardRequest(op["run_id"], job.data[start:start + count], job.loss_fn, job.loss_config,
                                           stage=op["id"] if queue.progress.staged else None))
        if not requests:  # every share was under one datum: each runs at least one next time (starved)
            return []
        backward = kind == OperationKind.FORWARD_BACKWARD
        try:
            results = self.backend.run_batch(requests, backward=backward)
        except BaseException as e:  # a bug: every operation of the batch fails as a server error
            log.exception("run_batch failed")
            results = [Failure.of(e)] * len(requests)
        ends = []
        for (queue, op, job, start, end), result in zip(planned, results):
            with self._lock:
                if self._runs.get(op["run_id"]) is not queue:  # cancelled meanwhile: cancel_run answered it
                    continue
            ended = end_of_part(self.backend, op, queue.progress, result, start, end, len(job.data), backward)
            if ended is not None:
                ends.append(ended)
        for op, _, _ in ends:
            self._advance(op)
        return ends

    def _run_singles(self, items: list[tuple[dict, Job]]) -> list[tuple[dict, dict | None, BaseException | Failure | None]]:
        """Ready operations other than forwards, of different runs: started in one store statement, every
        optim_step in one backend call (`optim_steps`), loads and saves one by one; returns their ends."""
        moved = self.store.set_operations([(op["id"], OperationStatus.RUNNING, None, None) for op, _ in items])
        ends, steps = [], []
        for (op, job), ok in zip(items, moved):
            if not ok:  # ended while queued (cancelled): skipped, the order moves on
                continue
            if isinstance(job, Refused):
                ends.append((op, None, job.failure))
            elif isinstance(job, OptimJob):
                steps.append((op, job.params))
            else:
                try:
                    ends.append((op, execute(self.backend, self.store, self.data_dir, op, job), None))
                except BaseException as e:
                    ends.append((op, None, e))
        if steps:
            try:
                results = self.backend.optim_steps([(op["run_id"], params) for op, params in steps])
            except BaseException as e:  # a bug: each of these steps fails as a server error
                log.exception("optim_steps failed")
                results = [Failure.of(e)] * len(steps)
            ends += [(op, None, r) if isinstance(r, Failure) else (op, {"metrics": r}, None)
                     for (op, _), r in zip(steps, results)]
        for (op, _), ok in zip(items, moved):
            if not ok:  # skipped: no end to store, but its run's order moves on
                self._advance(op)
        return ends

    def _run_sampling(self) -> bool:
        """Sampling steps of the backend; each request that ended in one is answered. On the training thread,
        steps until they took as long as the last training iteration (at least one): training and sampling
        get equal time while both have work, and a sample submitted meanwhile (a call of this lane) joins at
        the next step rather than waiting for the next training call."""
        if not self._samples:
            return False
        budget = self._training_seconds if self._sampling is self._training else 0.0
        start = time.monotonic()
        while True:
            self._sample_step()
            if not self._samples or time.monotonic() - start >= budget:
                return True
            self._run_calls(self._sampling)

    def _sample_step(self) -> None:
        """One sampling step of the backend; the requests that ended in it are answered together."""
        ends = []
        for request_id, outcome in self.backend.sample_step():
            if isinstance(outcome, SampleProgress):  # a streaming request's new tokens: to its listener
                with self._lock:
                    listener = self._streams.get(request_id)
                if listener is not None:
                    listener.put(outcome)
                continue
            op = self._samples.pop(request_id, None)
            if op is None:
                continue
            if isinstance(outcome, Failure):  # this request alone failed (and left its batch); the others go on
                ends.append((op, None, outcome))
            else:
                ends.append((op, sample_result(outcome), None))
        self._finish_all(ends)

    def _run_scoring(self) -> bool:
        """Score the next chunk (at most max_batch_tokens tokens) of the compute_logprobs request whose
        turn it is; requests take turns, so a long one does not hold up a short one."""
        with self._lock:
            if not self._scoring:
                return False
            job = self._scoring.pop(0)
        if job.done == 0:
            self.store.set_operation(job.operation["id"], OperationStatus.RUNNING)
        error = job.score_chunk(self.backend, self.max_batch_tokens)
        if error is not None:
            self._finish_all([(job.operation, None, error)])
        elif job.done == len(job.sequences):
            self._finish_all([(job.operation, {"logprobs": job.logprobs}, None)])
        else:
            with self._lock:
                self._scoring.append(job)
        return True

    def _expire_sessions(self) -> None:
        now = time.time()
        if now - self._last_expiry_check < self.expiry_interval:
            return
        self._last_expiry_check = now
        reap(self.store)  # checkpoints past their TTL that no one is reading (packages.py)
        for session_id in self.store.idle_sessions(now - self.session_timeout):
            self.store.end_session(session_id, SessionStatus.EXPIRED)
            for run in self.store.runs_of_session(session_id):
                if run["status"] in RUN_OPEN:
                    self.cancel_run(run["id"], "session expired")
