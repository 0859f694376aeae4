"""The scheduler: one worker thread owns the engine; runs' operations go in seq_id order.

Routes record an operation in the store, then hand its payload here. The worker wakes on an event
(never a sleep loop), picks for every run the operation whose seq_id is next, and sends the ready
forward_backward (or forward) operations of different runs to the engine as one mixed batch of at
most `max_batch_tokens` tokens, shared max-min fairly between the runs (`limits.plan_micro_batches`):
an operation larger than its share runs as several micro-batches, one per engine call, its gradient
staged in the engine until the last one succeeded, with other runs' work in between. Every other
operation runs alone. Between training batches the worker advances sampling by one decode step and
scoring (compute_logprobs) by one chunk, so none of them stalls the others for long. Each terminal
state is written to the store, then waiters are woken.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from whitney.engine import AdamParams, Datum, Engine, ForwardRequest, ForwardResult, LoraConfig, merge_results
from whitney.engine.sampler import SamplingParams
from whitney.errors import InvalidInput, WhitneyError
from whitney.service.limits import plan_micro_batches
from whitney.service.store import Store, new_id

log = logging.getLogger("whitney.scheduler")

TRAINING_KINDS = ("forward", "forward_backward", "optim_step", "save_state", "load_state",
                  "load_state_with_optimizer", "save_weights", "export_lora", "save_weights_for_sampler")
BATCHED_KINDS = ("forward", "forward_backward")


@dataclass
class _Progress:
    """A forward/forward_backward operation part-way through its micro-batches."""

    done: int = 0  # datums already run
    parts: list[ForwardResult] = field(default_factory=list)
    staged: bool = False  # runs in more than one micro-batch: its gradient is staged under its id


@dataclass
class _RunQueue:
    next_seq: int = 0
    pending: dict[int, tuple[dict, dict]] = field(default_factory=dict)  # seq_id -> (operation, payload)
    finishing: bool = False
    progress: _Progress | None = None  # of the operation at next_seq, once its first micro-batch ran
    served: int = 0  # the engine call that last ran its work (fairness: the least recently served first)
    starved: bool = False  # got no datum in the last engine call it was ready for


@dataclass
class _Scoring:
    """A compute_logprobs request, scored a chunk of sequences per worker iteration."""

    operation: dict
    sequences: list[list[int]]
    weights: dict
    done: int = 0
    logprobs: list = field(default_factory=list)


class Scheduler:
    def __init__(self, engine: Engine, store: Store, data_dir: Path, max_batch_tokens: int = 16384,
                 session_timeout: float = 600.0):
        self.engine = engine
        self.store = store
        self.data_dir = Path(data_dir)
        self.max_batch_tokens = max_batch_tokens
        self.session_timeout = session_timeout
        self._runs: dict[str, _RunQueue] = {}
        self._samples: list[tuple[dict, Any]] = []  # (operation, engine SampleRequest)
        self._scoring: list[_Scoring] = []
        self._calls_made = 0  # engine training calls so far (the fairness clock)
        self._calls: list[tuple[Callable, concurrent.futures.Future]] = []
        self._lock = threading.RLock()  # _finalize notifies waiters while holding it
        self._wake = threading.Event()
        self._stop = False
        self._waiters: dict[str, list[tuple[asyncio.AbstractEventLoop, asyncio.Future]]] = {}
        self._thread = threading.Thread(target=self._loop, name="whitney-worker", daemon=True)
        self._last_expiry_check = 0.0

    # ---- from any thread ----------------------------------------------------------------

    def start(self) -> None:
        """Run the worker loop on its own thread (tests, the demo's in-process server)."""
        self._thread.start()

    def run(self) -> None:
        """Run the worker loop on the calling thread until stop(). `whitney serve` runs it on the main
        thread: torch's OpenMP kernels launched from any other thread pay 50-120 us more per call here
        (libgomp keeps no spinning team for them), which halved decode throughput."""
        self._loop()

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run fn() on the worker thread (the engine's only user); the future carries its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            self._calls.append((fn, future))
        self._wake.set()
        return future

    def submit(self, operation: dict, payload: dict) -> None:
        """Queue a training operation already recorded in the store."""
        with self._lock:
            queue = self._runs.setdefault(operation["run_id"], _RunQueue())
            if operation["seq_id"] < queue.next_seq or operation["seq_id"] in queue.pending:
                return  # a retry of an operation already known
            queue.pending[operation["seq_id"]] = (operation, payload)
        self._wake.set()

    def submit_sample(self, operation: dict, prompt: list[int], params: SamplingParams, weights: dict) -> None:
        """Queue a sampling operation; `weights` names run_id+version, checkpoint_path or base_model."""
        def start() -> None:
            try:
                request = self.engine.submit_sample(prompt, params, **weights)
            except WhitneyError as e:
                self._finish(operation, error=e)
                return
            self.store.set_operation(operation["id"], "running")
            self._samples.append((operation, request))
        self.call(start)

    def submit_logprobs(self, operation: dict, sequences: list[list[int]], weights: dict) -> None:
        """Score sequences on the named weights (not in any run's seq_id order), a chunk per iteration."""
        with self._lock:
            self._scoring.append(_Scoring(operation, sequences, weights))
        self._wake.set()

    def open_run(self, run: dict, resume_path: str | None) -> concurrent.futures.Future:
        """Create the run's adapter in the engine (and load its bound checkpoint)."""
        def create() -> None:
            self.engine.create_run(run["id"], run["base_model"], LoraConfig.from_dict(run["lora"]))
            if resume_path is not None:
                try:
                    self.engine.load_state(run["id"], resume_path, with_optimizer=run["resume_with_optimizer"])
                except BaseException:
                    self.engine.delete_run(run["id"])
                    raise
            with self._lock:
                self._runs.setdefault(run["id"], _RunQueue())
        return self.call(create)

    def finish_run(self, run_id: str) -> concurrent.futures.Future:
        """Run what is queued, then mark the run finished (at once when nothing is queued)."""
        def finish() -> None:
            with self._lock:
                queue = self._runs.setdefault(run_id, _RunQueue())
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
            self.store.set_operation(op["id"], "cancelled", error={"code": "cancelled", "message": reason})
            self._notify(op["id"])
        for op_id in self.store.cancel_queued(run_id, reason):
            self._notify(op_id)
        def drop() -> None:
            self.engine.delete_run(run_id)
            self.store.set_run_status(run_id, "cancelled", only_from=("active", "finishing", "cancelling"))
        if queue is not None or run_id in self.engine.runs:
            self.call(drop)
        else:
            self.store.set_run_status(run_id, "cancelled", only_from=("active", "finishing", "cancelling"))

    async def wait(self, op_id: str, timeout: float) -> None:
        """Return when the operation may have become terminal, or after `timeout` seconds."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._waiters.setdefault(op_id, []).append((loop, future))
        if self.store.get_operation(op_id)["status"] in ("succeeded", "failed", "cancelled"):
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

    def _finish(self, operation: dict, result: dict | None = None, error: BaseException | None = None) -> None:
        if error is None:
            self.store.set_operation(operation["id"], "succeeded", result=result)
        elif isinstance(error, WhitneyError):
            self.store.set_operation(operation["id"], "failed", error={**error.to_dict(), "category": "user"})
        else:
            log.exception("operation %s (%s) failed", operation["id"], operation["kind"], exc_info=error)
            self.store.set_operation(operation["id"], "failed", error={
                "code": "internal", "message": f"{type(error).__name__}: {error}", "category": "server"})
        self._notify(operation["id"])

    def _loop(self) -> None:
        while not self._stop:
            self._wake.clear()
            try:
                did = self._run_calls()
                did |= self._run_training()
                did |= self._run_sampling()
                did |= self._run_scoring()
                self._expire_sessions()
            except Exception:  # a bug: log it and keep serving the other runs
                log.exception("scheduler iteration failed")
                did = False
            if not did:
                self._wake.wait(timeout=1.0)

    def _run_calls(self) -> bool:
        with self._lock:
            calls, self._calls = self._calls, []
        for fn, future in calls:
            try:
                future.set_result(fn())
            except BaseException as e:  # handed to the caller
                future.set_exception(e)
        return bool(calls)

    def _ready(self) -> list[tuple[_RunQueue, dict, dict]]:
        """For each run, its next operation if it has arrived; finish runs that are drained."""
        ready = []
        with self._lock:
            for run_id, queue in list(self._runs.items()):
                if queue.next_seq in queue.pending:
                    ready.append((queue, *queue.pending[queue.next_seq]))
                elif queue.finishing:
                    self._finalize(run_id, queue)
        return ready

    def _finalize(self, run_id: str, queue: _RunQueue) -> None:
        """A finishing run is drained: cancel what waits behind a missing seq_id, free its adapter."""
        del self._runs[run_id]
        for seq, (op, _) in queue.pending.items():
            self.store.set_operation(op["id"], "cancelled", error={
                "code": "cancelled",
                "message": f"run finished before seq_id {seq} could run (seq_id {queue.next_seq} never arrived)"})
            self._notify(op["id"])
        self.engine.delete_run(run_id)
        self.store.set_run_status(run_id, "finished", only_from=("active", "finishing"))

    def _advance(self, operation: dict) -> None:
        with self._lock:
            queue = self._runs.get(operation["run_id"])
            if queue is not None and queue.pending.pop(operation["seq_id"], None) is not None:
                queue.next_seq = operation["seq_id"] + 1
                queue.progress = None

    def _run_training(self) -> bool:
        """One engine call of ready forward/forward_backward work (fairly shared), then every ready
        operation of the other kinds."""
        ready = self._ready()
        if not ready:
            return False
        live = []
        for queue, op, payload in ready:
            # Cancelled while queued (store says so): skip, but keep the order moving.
            if queue.progress is None and self.store.get_operation(op["id"])["status"] != "queued":
                self._advance(op)
            else:
                live.append((queue, op, payload))
        batched = [item for item in live if item[1]["kind"] in BATCHED_KINDS]
        if batched:
            self._run_batch(batched)
        for _, op, payload in live:
            if op["kind"] not in BATCHED_KINDS:
                self._run_single(op, payload)
        return True

    def _run_batch(self, ready: list[tuple[_RunQueue, dict, dict]]) -> None:
        """One engine call: the least recently served run's kind (forward or forward_backward), and the
        ready operations of that kind, each whole or a micro-batch of it (`plan_micro_batches`)."""
        ready.sort(key=lambda item: item[0].served)
        kind = ready[0][1]["kind"]
        items = [item for item in ready if item[1]["kind"] == kind]
        remaining = []
        for queue, _, payload in items:
            lengths = payload.setdefault("lengths", [datum_length(d) for d in payload["data"]])
            remaining.append(lengths[queue.progress.done if queue.progress else 0:])
        counts = plan_micro_batches(remaining, self.max_batch_tokens, [q.starved for q, _, _ in items])
        self._calls_made += 1
        planned, requests = [], []
        for (queue, op, payload), count in zip(items, counts):
            queue.starved = count == 0
            if count == 0:
                continue
            queue.served = self._calls_made
            if queue.progress is None:
                queue.progress = _Progress(staged=count < len(payload["data"]))
                self.store.set_operation(op["id"], "running")
            start = queue.progress.done
            planned.append((queue, op, payload, start, start + count))
            requests.append(ForwardRequest(op["run_id"], payload["data"][start:start + count], payload["loss_fn"],
                                           payload["loss_config"], stage=op["id"] if queue.progress.staged else None))
        backward = kind == "forward_backward"
        try:
            results = self.engine.run_batch(requests, backward=backward)
        except BaseException as e:  # a bug: every operation of the batch fails as a server error
            results = [e] * len(requests)
        for (queue, op, payload, start, end), result in zip(planned, results):
            with self._lock:
                if self._runs.get(op["run_id"]) is not queue:  # cancelled meanwhile: cancel_run answered it
                    continue
            progress = queue.progress
            if isinstance(result, BaseException):
                if progress.staged:
                    self.engine.discard_gradients(op["run_id"], op["id"])
                if isinstance(result, WhitneyError) and result.datum_index is not None:
                    result.datum_index += start  # the index within the whole operation
                self._finish(op, error=result)
                self._advance(op)
                continue
            progress.parts.append(result)
            progress.done = end
            if end < len(payload["data"]):
                continue
            if progress.staged and backward:
                self.engine.commit_gradients(op["run_id"], op["id"])
            self._finish(op, result=forward_result_dict(merge_results(progress.parts)))
            self._advance(op)

    def _run_single(self, op: dict, payload: dict) -> None:
        self.store.set_operation(op["id"], "running")
        try:
            result = self._execute(op, payload)
        except BaseException as e:
            self._finish(op, error=e)
        else:
            self._finish(op, result=result)
        self._advance(op)

    def _execute(self, op: dict, p: dict) -> dict:
        run_id, kind, engine = op["run_id"], op["kind"], self.engine
        if "error" in p:  # refused when it arrived, but it holds its seq_id: it fails in its turn
            raise p["error"]
        if kind == "optim_step":
            return {"metrics": engine.optim_step(run_id, AdamParams.from_dict(p["adam_params"]))}
        if kind in ("load_state", "load_state_with_optimizer"):
            engine.load_state(run_id, p["path"], with_optimizer=kind == "load_state_with_optimizer")
            return {"checkpoint_id": p["checkpoint_id"]}
        run = self.store.get_run(run_id)
        package_id = new_id("pkg")
        path = self.data_dir / "packages" / package_id
        if kind == "save_state":
            engine.save_state(run_id, str(path), include_optimizer=p["include_optimizer"])
            package = self.store.register_package(run_id, run["owner"], "state", p["name"], str(path),
                                                  run["base_model"], p["include_optimizer"], package_id)
        elif kind == "save_weights":
            engine.save_weights(run_id, str(path), merge=p["merge"])
            package = self.store.register_package(run_id, run["owner"], "merged" if p["merge"] else "weights",
                                                  p["name"], str(path), run["base_model"], False, package_id)
        elif kind == "export_lora":
            engine.export_lora(run_id, str(path))
            package = self.store.register_package(run_id, run["owner"], "lora", p["name"], str(path),
                                                  run["base_model"], False, package_id)
        elif kind == "save_weights_for_sampler":
            version = engine.save_weights_for_sampler(run_id)
            # Also on disk, so the version outlives the run and a restart.
            engine.save_state(run_id, str(path), include_optimizer=False)
            package = self.store.register_package(run_id, run["owner"], "sampler", p.get("name") or str(version),
                                                  str(path), run["base_model"], False, package_id)
            return {"version": version, "package": public_package(package)}
        else:
            raise InvalidInput(f"unknown operation kind {kind!r}", field="kind")
        return {"package": public_package(package)}

    def _run_sampling(self) -> bool:
        if not self._samples:
            return False
        try:
            self.engine.sample_step()
        except Exception as e:  # a bug in a shared pass: fail what was sampling, start the samplers afresh
            for op, _ in self._samples:
                self._finish(op, error=e)
            self._samples = []
            self.engine.reset_sampling()
            return True
        still = []
        for op, request in self._samples:
            if request.error is not None:  # this request alone failed (and left its batch); the others go on
                self._finish(op, error=request.error)
            elif request.done:
                self._finish(op, result=sample_result_dict(request.result))
            else:
                still.append((op, request))
        self._samples = still
        return True

    def _run_scoring(self) -> bool:
        """Score the next chunk (at most max_batch_tokens tokens) of the compute_logprobs request whose
        turn it is; requests take turns, so a long one does not hold up a short one."""
        with self._lock:
            if not self._scoring:
                return False
            job = self._scoring.pop(0)
        if job.done == 0:
            self.store.set_operation(job.operation["id"], "running")
        lengths = [len(s) for s in job.sequences[job.done:]]
        (count,) = plan_micro_batches([lengths], self.max_batch_tokens, [False])
        try:
            job.logprobs += self.engine.compute_logprobs(job.sequences[job.done:job.done + count], **job.weights)
        except BaseException as e:
            if isinstance(e, WhitneyError) and e.datum_index is not None:
                e.datum_index += job.done
            error = e
        else:
            error = None
            job.done += count
        if error is not None:
            self._finish(job.operation, error=error)
        elif job.done == len(job.sequences):
            self._finish(job.operation, result={"logprobs": job.logprobs})
        else:
            with self._lock:
                self._scoring.append(job)
        return True

    def _expire_sessions(self) -> None:
        now = time.time()
        if now - self._last_expiry_check < 5.0:
            return
        self._last_expiry_check = now
        for session_id in self.store.idle_sessions(now - self.session_timeout):
            self.store.end_session(session_id, "expired")
            for run in self.store.runs_of_session(session_id):
                if run["status"] in ("active", "finishing"):
                    self.cancel_run(run["id"], "session expired")


def public_package(package: dict) -> dict:
    """A package as clients see it: no owner digest, no server path."""
    return {k: v for k, v in package.items() if k not in ("owner", "path", "deleted")}


def forward_result_dict(result) -> dict:
    return {
        "loss": result.loss,
        "metrics": result.metrics,
        "outputs": [{"logprobs": o.logprobs, "elementwise_loss": o.elementwise_loss} for o in result.outputs],
    }


def sample_result_dict(result) -> dict:
    return {
        "sequences": [{"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                      for s in result.sequences],
        "prompt_logprobs": result.prompt_logprobs,
        "topk_prompt_logprobs": result.topk_prompt_logprobs,
    }


def datum_length(datum: Datum) -> int:
    """Input tokens of a datum (its token_ids are a list of ints or of chunks)."""
    ids = datum.token_ids
    return sum(len(c) for c in ids) if ids and isinstance(ids[0], (list, tuple)) else len(ids)


def build_datums(data: list[dict]) -> list[Datum]:
    """Wire datums ({input: {token_ids}, loss_inputs}) as engine datums."""
    return [Datum(d["input"]["token_ids"], d.get("loss_inputs") or {}) for d in data]

