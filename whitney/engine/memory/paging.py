"""Idle runs paged out to disk and back in on their next use, bitwise equal to never having left.

A run untouched for `EngineConfig.page_idle_seconds` has every tensor it holds written to disk in this
engine's own directory under `paging_dir` and dropped from memory: its adapter (A and B of every module),
its accumulated gradient (a forward_backward whose optim_step has not come yet), the staged gradients of a
micro-batched operation part-way through and its sampler versions go to one file, AdamW's moments to a
second one. Its next use of any kind (`Engine.get_run`: forward_backward, optim_step, saves, exports,
sampling or scoring on a version) reads the first file back and deletes it; the moments (two thirds of a
stepped run's bytes) are read only when the run's optimizer is first used (`Run.optimizer`: an optim_step,
a save with the optimizer), so a forward or forward_backward after a page-in does not wait for them, and a
run paged out again before its next optim_step writes nothing for them. Values, dtypes, devices, strides
and `requires_grad` come back as they were, so every later number is the same.

The files' format and how they are written and read: engine/page_file.py.

A run whose state cannot be read back whole and as written (its file missing, truncated, or its bytes not
those written: page_file.py checks a checksum taken at page-out before any tensor is used) is lost, as with a
worker that died: the use fails with `RunStateLost` (a `WorkerLost`; its message names the run and what
happened, never a path), the run is forgotten (its files removed, its memory given back), its later uses fail
with the same error, and `take_lost` reports it once (the backend's `take_lost_runs`: the scheduler interrupts
it and fails its queued operations). Other runs are untouched. A read refused for want of a resource that comes
back (file descriptors, memory) is `Unavailable` instead, the run kept paged out.

Who pages out: the scheduler's worker thread, the one that owns the engine, calls `Engine.page_out_idle`
between engine calls (through `Backend.page_out_idle`); it is a clock comparison when nothing is due.
A run with sampling requests in flight on its versions stays (a request holds its adapter). The engine's
thread only takes the state out of the run; the pager's writer thread writes the files and then drops the
state, so neither a sweep nor a page-in that pushes a run out waits for a write (a page-out writes the run's
every tensor: docs/BENCHMARKS.md for its times). A run whose write is still in flight at its next use waits for it and is read back; a
write that fails (a full disk) puts the state back into its run (`Pager.collect`).

A residency budget (`EngineConfig.max_resident_runs`) bounds memory whatever the clock says: a run coming
into memory (created, or paged in for its next use) when that many are already there first pushes out the
least recently used one that the engine call in progress does not need (`Pager.pinned`) and no sampling
request holds. An engine call over more runs than the budget runs them a budget's worth at a time
(`Engine.run_batch`, `Engine.optim_steps`). Where every run in memory is needed or held, the run comes in
anyway: the budget is exceeded for as long as that lasts, never a request refused. The run pushed out is
written while the coming one is read in, so memory holds at most the budget's runs plus that one; a push-out
waits for the write before it (never two in flight).

Files live only as long as their process: each engine writes into a directory of its own
(`engine-<host>-<pid>-<random>`), removed by `close()`; directories of processes of the same host that
died are removed by the next engine that starts paging on the same `paging_dir`.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from whitney.engine.families.lora import Adapter
from whitney.heap import release_memory
from whitney.engine.memory.page_file import Layout, PagedMoments, PageFileLost, read_file, write_file
from whitney.engine.sampling.rows import SampleRequest
from whitney.engine.training.optim import OptimizerState
from whitney.engine.training.run import Run
from whitney.errors import InvalidInput, Unavailable
from whitney.protocol.backend import WorkerLost
from whitney.protocol.config import check_optional_count
from whitney.protocol.training import LoraConfig

log = logging.getLogger("whitney.engine.memory.paging")

# Pager.totals' counters (and /metrics'): how many and their seconds, of page-outs, page-ins and reads of
# AdamW moments left in their file at page-in.
_COUNTERS = {"out": ("page_outs", "page_out_seconds"), "in": ("page_ins", "page_in_seconds"),
             "moments": ("moment_reads", "moment_read_seconds")}
# ... and their times' histograms (in `residency`, {upper bound: count} each; the last bound "+Inf").
_HISTOGRAMS = {"out": "page_out_histogram", "in": "page_in_histogram", "moments": "moment_read_histogram"}
SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_BUCKET_NAMES = [repr(b) for b in SECONDS_BUCKETS] + ["+Inf"]

# A read that fails with one of these may succeed later: the run stays paged out (Unavailable), not lost.
_TRANSIENT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN, errno.EINTR}


class RunStateLost(WorkerLost):
    """A paged-out run's state could not be read back (its page file missing, truncated or damaged): it is
    gone, as with a worker that died. The message names the run and the cause, never a server path."""


def check_page_idle_seconds(value: float | None) -> None:
    """None (never page out) or a finite number of seconds >= 0."""
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    if not ok:
        raise InvalidInput(f"page_idle_seconds must be a finite number of seconds >= 0 (or unset: never page "
                           f"out), got {value!r}", field="page_idle_seconds")


@dataclass
class _Leaving:
    """A run's state on its way to its files: the writer thread drops it once written."""

    adapter: Adapter
    optimizer: OptimizerState | PagedMoments
    grads: dict[str, torch.Tensor]
    staged: dict[str, dict[str, torch.Tensor]]
    versions: dict[int, Adapter]

    def drop(self) -> None:
        self.adapter = self.optimizer = None  # type: ignore[assignment]
        self.grads, self.staged, self.versions = {}, {}, {}


@dataclass
class PagedRun:
    """What stays in memory of a paged-out run: its file, what is in it and the configs of its adapters."""

    path: Path
    entries: Layout
    lora: LoraConfig  # the adapter's
    versions: dict[int, LoraConfig]  # each sampler version's
    optimizer: OptimizerState | PagedMoments  # AdamW's state: in memory when it has no moments yet
    nbytes: int  # its files' (adapter and the rest, and moments)
    written: bool = False  # its files are written and its state dropped from memory
    digest: bytes = b""  # the checksum of its file's tensor bytes (page_file.py), set once written


class Pager:
    """Which runs are paged out, where, and when each run was last used. One per Engine, on its thread."""

    def __init__(self, runs: dict[str, Run], idle_seconds: float | None, directory: str | None,
                 max_resident: int | None = None):
        check_page_idle_seconds(idle_seconds)
        check_optional_count("max_resident_runs", max_resident, "no budget")
        self.runs = runs  # the engine's own dict: every live run, in memory or out
        self.idle_seconds = idle_seconds
        self.max_resident = max_resident
        self.pinned: set[str] = set()  # runs the engine call in progress uses: the budget never pushes them out
        self.root = Path(directory) if directory else Path(tempfile.gettempdir()) / "whitney-paged"
        self.last_used: dict[str, float] = {}  # run id -> time.monotonic() of its last use
        self.paged: dict[str, PagedRun] = {}
        self.totals = {name: 0 for names in _COUNTERS.values() for name in names}
        self.histograms = {kind: [0] * len(_BUCKET_NAMES) for kind in _COUNTERS}  # counts per bucket (not cumulative)
        self.holds: list[tuple[str, SampleRequest]] = []  # sampling requests on runs' versions, not yet ended
        self.leaving: dict[str, Future] = {}  # run id -> its page-out's write, until `collect` finishes it
        self.lost: dict[str, str] = {}  # run id -> why its state is gone (its uses fail with it until deleted)
        self._newly_lost: list[str] = []  # lost since the last `take_lost`
        self._writer: ThreadPoolExecutor | None = None  # the thread that writes page files, made at the first
        self._dir: Path | None = None  # this engine's own directory, made at its first page-out
        self._files = 0
        self._next_sweep = 0.0

    # ---- bookkeeping -----------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.idle_seconds is not None or self.max_resident is not None

    def touch(self, run: Run) -> None:
        """A use of the run: page it back in if it is out (making room first, under a budget), note the time."""
        coming_in = run.run_id in self.paged or run.run_id not in self.last_used  # paged out, or new
        if coming_in and self.max_resident is not None:
            self.make_room(run.run_id)
        if run.run_id in self.paged:
            self.page_in(run)
        self.last_used[run.run_id] = time.monotonic()

    def make_room(self, coming: str) -> int:
        """Under the budget, page out the least recently used runs in memory until `coming` fits, sparing the
        pinned and held ones; how many went (the budget is exceeded where none can go)."""
        self.settle()  # at most one run's state in memory beyond the budget: the one about to be written
        resident = [r for r in self.last_used if r not in self.paged and r != coming]
        excess = len(resident) + 1 - self.max_resident
        if excess <= 0:
            return 0
        self._drop_ended_holds(time.monotonic())
        spared = self.pinned | {r for r, _ in self.holds}
        victims = sorted((r for r in resident if r not in spared), key=self.last_used.__getitem__)[:excess]
        paged, _ = self._page_out_each(victims)  # one that cannot be written stays, over budget
        return paged

    @contextlib.contextmanager
    def pinning(self, run_ids: set[str]):
        """While inside, the budget pushes none of these runs out (one engine call's runs)."""
        self.pinned = set(run_ids)
        try:
            yield
        finally:
            self.pinned = set()

    def budget_parts(self, run_ids: list[str | None]) -> list[list[int]]:
        """Indices of `run_ids` (one per request; None: no run) cut into parts of at most max_resident distinct
        runs each, runs in order of first appearance, every index of a run in the same part; [all] when there
        is no budget or it is not exceeded."""
        distinct = list(dict.fromkeys(r for r in run_ids if r is not None))
        if self.max_resident is None or len(distinct) <= self.max_resident:
            return [list(range(len(run_ids)))] if run_ids else []
        part_of = {r: k // self.max_resident for k, r in enumerate(distinct)}
        parts: list[list[int]] = [[] for _ in range(-(-len(distinct) // self.max_resident))]
        for i, r in enumerate(run_ids):
            parts[part_of[r] if r is not None else 0].append(i)
        return parts

    def hold(self, run_id: str, request: SampleRequest) -> None:
        """A sampling request on one of the run's versions: the run stays in memory until it ends."""
        if self.enabled:
            self.holds.append((run_id, request))

    def _drop_ended_holds(self, now: float) -> None:
        for run_id, request in self.holds:
            if request.done and run_id in self.last_used:  # a request's end is its run's last use
                self.last_used[run_id] = now
        self.holds = [(r, q) for r, q in self.holds if not q.done]

    def forget(self, run_id: str) -> None:
        """The run is gone: its files too."""
        self.collect(run_id)
        self.lost.pop(run_id, None)
        self.last_used.pop(run_id, None)
        paged = self.paged.pop(run_id, None)
        if paged is not None:
            paged.path.unlink(missing_ok=True)
        run = self.runs.get(run_id)
        for optimizer in (paged and paged.optimizer, run and run.optimizer_state):
            if isinstance(optimizer, PagedMoments):
                optimizer.discard()

    def page_out_idle(self) -> int:
        """Page out the runs untouched for idle_seconds, except those with sampling requests in flight; how
        many. A clock comparison when paging is off or no sweep is due (one every min(1 s, idle_seconds / 2))."""
        now = time.monotonic()
        if self.idle_seconds is None or now < self._next_sweep:
            return 0
        self._next_sweep = now + min(1.0, self.idle_seconds / 2)
        if self.collect():  # a write of the last sweep failed: its run is back, sweeps wait a minute
            return 0
        self._drop_ended_holds(now)
        held = {r for r, _ in self.holds}
        cutoff = now - self.idle_seconds
        idle = [r for r, t in self.last_used.items() if t <= cutoff and r not in self.paged and r not in held]
        paged, failed = self._page_out_each(idle)
        if failed:  # runs stay in memory; try again in a minute
            self._next_sweep = now + 60.0
        return paged

    def _page_out_each(self, run_ids: list[str]) -> tuple[int, bool]:
        """Start paging these runs out in order; (how many went, whether one could not be: its directory
        cannot be made, and the rest stay in memory)."""
        paged = 0
        for run_id in run_ids:
            try:
                self.page_out(self.runs[run_id])
                paged += 1
            except OSError as e:
                log.warning("could not page out run %s: %s", run_id, e)
                break
        return paged, paged < len(run_ids)

    def residency(self, runs: int) -> dict:
        """Runs in memory and paged out, of `runs` (one whose files are still being written is in memory:
        its state is); page-outs, page-ins and moment reads so far, their total seconds and their seconds'
        histograms (safe from another thread: list() copies the dict's values in one step under the GIL)."""
        paged = sum(1 for p in list(self.paged.values()) if p.written)
        histograms = {_HISTOGRAMS[kind]: dict(zip(_BUCKET_NAMES, counts)) for kind, counts in self.histograms.items()}
        return {"in_memory": max(0, runs - paged), "paged_out": paged, **self.totals, **histograms}

    def close(self) -> None:
        """Remove this engine's directory (its paged runs' state with it: call when the engine ends)."""
        if self._writer is not None:
            self._writer.shutdown(wait=True)
            self._writer = None
            self.leaving.clear()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.paged.clear()

    # ---- out and in ------------------------------------------------------------------------

    def page_out(self, run: Run) -> None:
        """Take every tensor the run holds out of it and write them to its files on the pager's writer thread
        (the memory goes once written: `settle` waits for that). AdamW's moments go to a file of their own,
        unless they are still in one from the last page-out (not read since: nothing is written for them). A
        write that fails puts the state back in the run (`collect`)."""
        path = self._new_path()  # on this thread: a directory that cannot be made fails here, the run kept
        leaving = _Leaving(run.adapter, run.optimizer_state, run.grads, run.staged, run.sampler_versions)
        paged = PagedRun(path, [], run.adapter.config, {v: a.config for v, a in run.sampler_versions.items()},
                         run.optimizer_state, 0)
        self.paged[run.run_id] = paged
        run.adapter = None  # type: ignore[assignment]  # paged out: only Engine.get_run brings it back
        run.optimizer_state = None
        run.grads, run.staged, run.sampler_versions = {}, {}, {}
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="whitney-page-out")
        self.leaving[run.run_id] = self._writer.submit(self._write_run, run.run_id, leaving, paged)

    def _write_run(self, run_id: str, leaving: _Leaving, paged: PagedRun) -> _Leaving | None:
        """On the writer thread: write the state to the run's files and fill in `paged`, then drop the state
        (its memory goes back to the system); the state itself if it could not be written."""
        start = time.perf_counter()
        groups = [("adapter", "", leaving.adapter.named_parameters()), ("grads", "", leaving.grads.items()),
                  *(("staged", stage, grads.items()) for stage, grads in leaving.staged.items()),
                  *(("version", str(v), a.named_parameters()) for v, a in leaving.versions.items())]
        optimizer = leaving.optimizer  # in memory, or still in its own file (PagedMoments)
        try:
            paged.entries, total, paged.digest = write_file(paged.path, groups)
            if isinstance(optimizer, OptimizerState) and optimizer.exp_avg:
                moments_path = paged.path.with_suffix(".moments.bin")
                try:
                    entries, nbytes, digest = write_file(moments_path, [
                        ("exp_avg", "", optimizer.exp_avg.items()), ("exp_avg_sq", "", optimizer.exp_avg_sq.items())])
                except BaseException:
                    paged.path.unlink(missing_ok=True)
                    raise
                optimizer = PagedMoments(moments_path, entries, optimizer.step, nbytes, self.read_moments, digest,
                                         run_id)
        except Exception as e:  # a full or unwritable disk above all; whatever it is, the run keeps its state
            log.warning("could not page out run %s: %s", run_id, e, exc_info=not isinstance(e, OSError))
            return leaving
        paged.optimizer = optimizer
        paged.nbytes = total + _nbytes(optimizer)
        del groups, optimizer
        leaving.drop()
        release_memory()
        paged.written = True
        self._timed("out", start, f"paged out run {run_id}: {paged.nbytes / 2**20:.1f} MB")
        return None

    def collect(self, run_id: str | None = None) -> bool:
        """Finish the page-outs whose writes ended (all of them; with run_id, that run's, waiting for it): a
        failed one's state goes back into its run, which stays in memory. Whether one failed."""
        failed = False
        for r in [run_id] if run_id in self.leaving else [r for r, f in self.leaving.items() if f.done()]:
            leaving = self.leaving.pop(r).result()
            if leaving is not None:  # not written: back into the run
                run = self.runs[r]
                run.adapter, run.optimizer_state, run.grads = leaving.adapter, leaving.optimizer, leaving.grads
                run.staged, run.sampler_versions = leaving.staged, leaving.versions
                del self.paged[r]
                failed = True
        if failed:
            self._next_sweep = time.monotonic() + 60.0  # the disk is full or unwritable: try again in a minute
        return failed

    def settle(self) -> bool:
        """Wait for every page-out in flight and finish it (`collect`); whether one failed."""
        failed = False
        for run_id in list(self.leaving):
            failed |= self.collect(run_id)
        return failed

    def page_in(self, run: Run) -> None:
        """Read the run's file back into the run (equal values, layouts and flags) and delete the file. AdamW's
        moments stay in their own file until the run's optimizer is first used (`Run.optimizer`)."""
        start = time.perf_counter()
        if self.collect(run.run_id) and run.run_id not in self.paged:  # its write failed: it never left
            return
        paged = self.paged[run.run_id]
        A: dict[str, dict[str, torch.Tensor]] = {"": {}}  # adapter group ("" or a version) -> module -> A
        B: dict[str, dict[str, torch.Tensor]] = {"": {}}
        grads: dict[str, torch.Tensor] = {}
        staged: dict[str, dict[str, torch.Tensor]] = {}
        with self._reading(run.run_id, "page file"):  # every tensor read and checked before any is used
            for t, e in read_file(paged.path, paged.entries, run.base.device, paged.digest):
                if e.kind in ("adapter", "version"):
                    module, ab = e.name.rsplit(".lora_", 1)
                    (A if ab == "A" else B).setdefault(e.group, {})[module] = t
                elif e.kind == "grads":
                    grads[e.name] = t
                else:
                    staged.setdefault(e.group, {})[e.name] = t
        run.adapter = Adapter(paged.lora, A[""], B[""])
        run.optimizer_state = paged.optimizer
        run.grads, run.staged = grads, staged
        run.sampler_versions = {v: Adapter(config, A.get(str(v), {}), B.get(str(v), {}))
                                for v, config in paged.versions.items()}
        del self.paged[run.run_id]
        self._timed("in", start, f"paged in run {run.run_id}: {(paged.nbytes - _nbytes(paged.optimizer)) / 2**20:.1f} MB")

    def read_moments(self, moments: PagedMoments, device: torch.device) -> OptimizerState:
        """AdamW's state of a paged-in run, read back from its own file (then deleted)."""
        start = time.perf_counter()
        optimizer = OptimizerState(step=moments.step)
        with self._reading(moments.run_id, "AdamW moments file"):
            for t, e in read_file(moments.path, moments.entries, device, moments.digest):
                getattr(optimizer, e.kind)[e.name] = t
        self._timed("moments", start, f"read AdamW moments: {moments.nbytes / 2**20:.1f} MB")
        return optimizer

    @contextlib.contextmanager
    def _reading(self, run_id: str, what: str):
        """Around reading one of the run's files: a file that cannot be read back as written loses the run
        (RunStateLost); a read short of a resource that comes back is Unavailable (the run stays paged out)."""
        try:
            yield
        except (PageFileLost, OSError) as e:
            if isinstance(e, OSError) and e.errno in _TRANSIENT_ERRNOS:
                log.warning("could not read the %s of run %s now: %s", what, run_id, e)
                raise Unavailable(f"run {run_id!r} is paged out and cannot be read back in right now "
                                  f"({e.strerror}); try again shortly", field="run_id") from None
            log.error("run %s lost its paged-out state: its %s could not be read back: %s", run_id, what, e)
            raise self._lose(run_id, str(e) if isinstance(e, PageFileLost)
                             else f"reading its {what} failed: {e.strerror or type(e).__name__}") from None

    def _lose(self, run_id: str, cause: str) -> RunStateLost:
        """The run's state is gone: forget the run (files and memory), remember why, report it once."""
        message = (f"run {run_id!r} lost its state: it was paged out to disk and could not be read back ({cause}); "
                   "its adapter, gradients and optimizer state are gone, so the run is interrupted: resume from its "
                   "newest saved state with a new run")
        self.forget(run_id)
        self.lost[run_id] = message  # before the run leaves `runs`: another thread's `validate` sees one or the other
        self.runs.pop(run_id, None)
        self._newly_lost.append(run_id)
        release_memory()
        return RunStateLost(message)

    def take_lost(self) -> list[str]:
        """The runs lost since the last call (`Housekeeping.take_lost_runs`)."""
        lost, self._newly_lost = self._newly_lost, []
        return lost

    def _timed(self, kind: str, start: float, what: str) -> None:
        seconds = time.perf_counter() - start
        self.histograms[kind][bisect.bisect_left(SECONDS_BUCKETS, seconds)] += 1
        count, total = _COUNTERS[kind]
        self.totals[count] += 1
        self.totals[total] += seconds
        log.info("%s in %.0f ms", what, seconds * 1e3)

    def _new_path(self) -> Path:
        if self._dir is None:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.root)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{_own_prefix()}{os.getpid()}-", dir=self.root))
        self._files += 1
        return self._dir / f"run-{self._files}.bin"


def _nbytes(optimizer) -> int:
    return optimizer.nbytes if isinstance(optimizer, PagedMoments) else 0


def _own_prefix() -> str:
    """Directory names start with the host's name: on a directory shared by several nodes, an engine only
    judges which processes of its own host have ended."""
    return f"engine-{socket.gethostname()}-"


def remove_leftovers(root: Path) -> None:
    """Remove the directories of engines of this host whose process has ended (their runs ended with them)."""
    prefix = _own_prefix()
    for d in root.glob(f"{prefix}*"):
        pid = d.name[len(prefix):].split("-")[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
