"""Idle runs paged out to disk and back in on their next use, bitwise equal to never having left.

A run untouched for `EngineConfig.page_idle_seconds` has every tensor it holds written to one file in this
engine's own directory under `paging_dir` and dropped from memory: its adapter (A and B of every module),
AdamW's moments and step count, its accumulated gradient (a forward_backward whose optim_step has not come
yet), the staged gradients of a micro-batched operation part-way through, and its sampler versions. The
file is the tensors' bytes one after another, each at an offset that is a multiple of 64 bytes, written with
a few `writev` calls; what each one is stays in memory (`PagedRun`), so the file needs no header. Its next
use of any kind (`Engine.get_run`: forward_backward, optim_step, saves, exports, sampling or scoring on a
version) reads the file back first and deletes it. Values, dtypes, devices, strides and `requires_grad` come
back as they were, so every later number is the same.

Reading back: the tensors of one block (the adapter, each AdamW moment, the gradients, one stage, one
version: tensors that are dropped together) are read with one `readinto` into memory of their own and each
tensor is built over its bytes (`torch.frombuffer`, then `set_` to its shape and strides: a leaf, not a
view). A block of 2 MB or more gets an anonymous mapping advised into 2 MB pages (`MADV_HUGEPAGE`): most of
a page-in was the kernel faulting fresh memory in 4 KB at a time, which 2 MB pages make about three times
cheaper (`_fresh_memory`). The mapping goes back to the system (munmap) when the block's last tensor is
dropped. The file's cached pages are freed by closing it on a thread of its own. A rank-32 SmolLM2 run
with AdamW state (130 MB) on a loaded 2-core VM: page-in p50 180-260 ms reading each tensor into memory
from the allocator, 47-75 ms this way; page-out p50 105-155 ms with a write per tensor, 77-113 ms with writev.

Who pages out: the scheduler's worker thread, the one that owns the engine, calls `Engine.page_out_idle`
between engine calls (through `Backend.page_out_idle`); it is a clock comparison when nothing is due.
A run with sampling requests in flight on its versions stays (a request holds its adapter).

A residency budget (`EngineConfig.max_resident_runs`) bounds memory whatever the clock says: a run coming
into memory (created, or paged in for its next use) when that many are already there first pushes out the
least recently used one that the engine call in progress does not need (`Pager.pinned`) and no sampling
request holds. An engine call over more runs than the budget runs them a budget's worth at a time
(`Engine.run_batch`, `Engine.optim_steps`). Where every run in memory is needed or held, the run comes in
anyway: the budget is exceeded for as long as that lasts, never a request refused.

Files live only as long as their process: each engine writes into a directory of its own
(`engine-<host>-<pid>-<random>`), removed by `close()`; directories of processes of the same host that
died are removed by the next engine that starts paging on the same `paging_dir`.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import mmap
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from whitney.engine.lora import Adapter, LoraConfig
from whitney.engine.optim import OptimizerState
from whitney.engine.sampler import SampleRequest
from whitney.errors import InvalidInput

if TYPE_CHECKING:
    from whitney.engine.runs import Run

log = logging.getLogger("whitney.engine.paging")

_ALIGN = 64  # bytes: every tensor starts at a multiple of this in its file and in memory
_HUGE_BLOCK = 2 * 2**20  # blocks of at least this many bytes get memory of their own in 2 MB pages
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
_FLUSH_BYTES = 64 * 2**20  # a page-out writes what it has gathered at this size (bounds copies off a GPU)
_ZEROS = bytes(_ALIGN)

# glibc's malloc_trim (None elsewhere): freed heap goes back to the system. glibc serves tensors below its
# mmap threshold (which grows up to 32 MB as large blocks are freed) from the heap, and keeps what is freed.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None


def release_memory() -> None:
    """Give memory freed by dropped tensors back to the system (glibc on Linux; elsewhere a no-op)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def check_max_resident_runs(value: int | None) -> None:
    """None (no budget) or an integer >= 1."""
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise InvalidInput(f"max_resident_runs must be an integer >= 1 (or unset: no budget), got {value!r}",
                           field="max_resident_runs")


def check_page_idle_seconds(value: float | None) -> None:
    """None (never page out) or a finite number of seconds >= 0."""
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < float("inf")
    if not ok:
        raise InvalidInput(f"page_idle_seconds must be a finite number of seconds >= 0 (or unset: never page "
                           f"out), got {value!r}", field="page_idle_seconds")


@dataclass(frozen=True)
class _Entry:
    """One tensor in a page file (they follow one another in this order): where it came from, its layout, and
    its bytes (its storage in memory order)."""

    kind: str  # adapter, exp_avg, exp_avg_sq, grads, staged, version
    group: str  # the stage (staged) or the version number (version); "" otherwise
    name: str  # the weight's name ({module path}.lora_A / .lora_B)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    nbytes: int
    offset: int  # where its bytes start in the file (a multiple of _ALIGN)


@dataclass
class PagedRun:
    """What stays in memory of a paged-out run: its file, what is in it and the configs of its adapters."""

    path: Path
    entries: list[_Entry]
    lora: LoraConfig  # the adapter's
    versions: dict[int, LoraConfig]  # each sampler version's
    step: int  # AdamW's
    nbytes: int


class Pager:
    """Which runs are paged out, where, and when each run was last used. One per Engine, on its thread."""

    def __init__(self, runs: dict[str, "Run"], idle_seconds: float | None, directory: str | None,
                 max_resident: int | None = None):
        check_page_idle_seconds(idle_seconds)
        check_max_resident_runs(max_resident)
        self.runs = runs  # the engine's own dict: every live run, in memory or out
        self.idle_seconds = idle_seconds
        self.max_resident = max_resident
        self.pinned: set[str] = set()  # runs the engine call in progress uses: the budget never pushes them out
        self.root = Path(directory) if directory else Path(tempfile.gettempdir()) / "whitney-paged"
        self.last_used: dict[str, float] = {}  # run id -> time.monotonic() of its last use
        self.paged: dict[str, PagedRun] = {}
        self.seconds = {"out": deque(maxlen=1000), "in": deque(maxlen=1000)}  # recent page-out/in times
        self.totals = {"page_outs": 0, "page_ins": 0, "page_out_seconds": 0.0, "page_in_seconds": 0.0}
        self.holds: list[tuple[str, SampleRequest]] = []  # sampling requests on runs' versions, not yet ended
        self._dir: Path | None = None  # this engine's own directory, made at its first page-out
        self._files = 0
        self._next_sweep = 0.0

    # ---- bookkeeping -----------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self.idle_seconds is not None or self.max_resident is not None

    def touch(self, run: "Run") -> None:
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
        """The run is gone: its file too."""
        self.last_used.pop(run_id, None)
        paged = self.paged.pop(run_id, None)
        if paged is not None:
            paged.path.unlink(missing_ok=True)

    def page_out_idle(self) -> int:
        """Page out the runs untouched for idle_seconds, except those with sampling requests in flight; how
        many. A clock comparison when paging is off or no sweep is due (one every min(1 s, idle_seconds / 2))."""
        now = time.monotonic()
        if self.idle_seconds is None or now < self._next_sweep:
            return 0
        self._next_sweep = now + min(1.0, self.idle_seconds / 2)
        self._drop_ended_holds(now)
        held = {r for r, _ in self.holds}
        cutoff = now - self.idle_seconds
        idle = [r for r, t in self.last_used.items() if t <= cutoff and r not in self.paged and r not in held]
        paged, failed = self._page_out_each(idle)
        if failed:  # runs stay in memory; try again in a minute
            self._next_sweep = now + 60.0
        return paged

    def _page_out_each(self, run_ids: list[str]) -> tuple[int, bool]:
        """Page these runs out in order, then give the memory back; (how many went, whether one could not be
        written: the disk is full or unwritable, and the rest stay in memory)."""
        paged = 0
        for run_id in run_ids:
            try:
                self.page_out(self.runs[run_id])
                paged += 1
            except OSError as e:
                log.warning("could not page out run %s: %s", run_id, e)
                break
        if paged:
            release_memory()
        return paged, paged < len(run_ids)

    def residency(self, runs: int) -> dict[str, float]:
        """Runs in memory and paged out, of `runs`, and page-outs and page-ins so far with their total
        seconds (reads of sizes and numbers: safe from another thread)."""
        paged = len(self.paged)
        return {"in_memory": max(0, runs - paged), "paged_out": paged, **self.totals}

    def close(self) -> None:
        """Remove this engine's directory (its paged runs' state with it: call when the engine ends)."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        self.paged.clear()

    # ---- out and in ------------------------------------------------------------------------

    def page_out(self, run: "Run") -> None:
        """Write every tensor the run holds to its file and drop them from the run (then from memory)."""
        start = time.perf_counter()
        groups = [("adapter", "", run.adapter.named_parameters()),
                  ("exp_avg", "", run.optimizer.exp_avg.items()), ("exp_avg_sq", "", run.optimizer.exp_avg_sq.items()),
                  ("grads", "", run.grads.items()),
                  *(("staged", stage, grads.items()) for stage, grads in run.staged.items()),
                  *(("version", str(v), a.named_parameters()) for v, a in run.sampler_versions.items())]
        path, entries, total = self._new_path(), [], 0
        try:
            with open(path, "wb", buffering=0) as f:
                pending, pending_bytes, offset = [], 0, 0  # buffers gathered for the next writev
                for kind, group, named in groups:
                    for name, t in named:
                        requires_grad, t = t.requires_grad, t.detach()
                        if not (t.is_contiguous() or _covers_storage(t)):
                            t = t.contiguous()  # values kept; only a dense layout (a transpose) is kept as is
                        flat = t.cpu().as_strided((t.numel(),), (1,))  # [numel]: its storage in memory order
                        nbytes = t.numel() * t.element_size()
                        pad = -offset % _ALIGN  # zeros up to the next multiple of _ALIGN
                        if pad:
                            pending.append(_ZEROS[:pad])
                            offset += pad
                        entries.append(_Entry(kind, group, name, tuple(t.shape), t.stride(), t.dtype,
                                              requires_grad, nbytes, offset))
                        pending.append(flat.view(torch.uint8).numpy())
                        offset, pending_bytes, total = offset + nbytes, pending_bytes + nbytes, total + nbytes
                        if pending_bytes >= _FLUSH_BYTES or len(pending) >= _IOV_MAX:
                            _write(f, pending)
                            pending, pending_bytes = [], 0
                _write(f, pending)
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        self.paged[run.run_id] = PagedRun(path, entries, run.adapter.config,
                                          {v: a.config for v, a in run.sampler_versions.items()},
                                          run.optimizer.step, total)
        run.adapter = None  # type: ignore[assignment]  # paged out: only Engine.get_run brings it back
        run.optimizer = None  # type: ignore[assignment]
        run.grads, run.staged, run.sampler_versions = {}, {}, {}
        seconds = time.perf_counter() - start
        self.seconds["out"].append(seconds)
        self.totals["page_outs"] += 1
        self.totals["page_out_seconds"] += seconds
        log.info("paged out run %s: %.1f MB in %.0f ms", run.run_id, total / 2**20, seconds * 1e3)

    def page_in(self, run: "Run") -> None:
        """Read the run's file back into the run (equal values, layouts and flags) and delete the file."""
        start = time.perf_counter()
        paged = self.paged[run.run_id]
        device = run.base.device
        A: dict[str, dict[str, torch.Tensor]] = {"": {}}  # adapter group ("" or a version) -> module -> A
        B: dict[str, dict[str, torch.Tensor]] = {"": {}}
        optimizer = OptimizerState(step=paged.step)
        grads: dict[str, torch.Tensor] = {}
        staged: dict[str, dict[str, torch.Tensor]] = {}
        f = open(paged.path, "rb", buffering=0)
        try:
            for t, e in _read_blocks(f, paged.entries, f"page file {paged.path} of run {run.run_id!r}"):
                t = t.to(device).requires_grad_(e.requires_grad)
                if e.kind in ("adapter", "version"):
                    module, ab = e.name.rsplit(".lora_", 1)
                    (A if ab == "A" else B).setdefault(e.group, {})[module] = t
                elif e.kind in ("exp_avg", "exp_avg_sq"):
                    getattr(optimizer, e.kind)[e.name] = t
                elif e.kind == "grads":
                    grads[e.name] = t
                else:
                    staged.setdefault(e.group, {})[e.name] = t
        except BaseException:
            f.close()
            raise
        run.adapter = Adapter(paged.lora, A[""], B[""])
        run.optimizer = optimizer
        run.grads, run.staged = grads, staged
        run.sampler_versions = {v: Adapter(config, A.get(str(v), {}), B.get(str(v), {}))
                                for v, config in paged.versions.items()}
        del self.paged[run.run_id]
        if os.name == "nt":  # an open file cannot be deleted there
            f.close()
        # The name goes now; the file's pages in the cache are freed when it is closed (14 ms for 130 MB), which
        # another thread does, off the engine's.
        paged.path.unlink(missing_ok=True)
        threading.Thread(target=f.close, name="whitney-page-file-close", daemon=True).start()
        seconds = time.perf_counter() - start
        self.seconds["in"].append(seconds)
        self.totals["page_ins"] += 1
        self.totals["page_in_seconds"] += seconds
        log.info("paged in run %s: %.1f MB in %.0f ms", run.run_id, paged.nbytes / 2**20, seconds * 1e3)

    def _new_path(self) -> Path:
        if self._dir is None:
            self.root.mkdir(parents=True, exist_ok=True)
            remove_leftovers(self.root)
            self._dir = Path(tempfile.mkdtemp(prefix=f"{_own_prefix()}{os.getpid()}-", dir=self.root))
        self._files += 1
        return self._dir / f"run-{self._files}.bin"


def _write(f, buffers: list) -> None:
    """Write the buffers one after another: one writev per _IOV_MAX of them (a short write is resumed)."""
    views = [v for v in (memoryview(b).cast("B") for b in buffers) if len(v)]  # an empty one would stall
    i = 0
    while i < len(views):
        if hasattr(os, "writev"):
            written = os.writev(f.fileno(), views[i:i + _IOV_MAX])
        else:  # Windows
            written = f.write(views[i])
        while written and written >= len(views[i]):
            written -= len(views[i])
            i += 1
        if written:  # part of views[i] was written
            views[i] = views[i][written:]


def _read_blocks(f, entries: list[_Entry], what: str):
    """Each entry's tensor (on the CPU) with its entry, in order, read from file f one block at a time: the
    consecutive entries of one kind and group are dropped together, so they share memory of their own."""
    for _, same in itertools.groupby(entries, key=lambda e: (e.kind, e.group)):
        block = list(same)
        first, last = block[0].offset, block[-1].offset + block[-1].nbytes
        memory = _fresh_memory(last - first)
        f.seek(first)
        view, done = memoryview(memory), 0
        while done < len(view):  # one readinto, more only past the 2 GB a Linux read returns at most
            n = f.readinto(view[done:])
            if not n:
                raise RuntimeError(f"{what} is truncated")
            done += n
        for e in block:
            yield _tensor_over(memory, e.offset - first, e), e


def _fresh_memory(nbytes: int):
    """A writable buffer of nbytes, 64-byte aligned. From 2 MB up an anonymous mapping of its own, advised
    into 2 MB pages: measured on a 2-core VM reading 130 MB from the page cache, 4 KB pages took ~180 ms
    (faults and zeroing), 2 MB pages ~50 ms; unmapped once nothing refers to it (the tensors built over it
    hold it). Smaller blocks come from torch's allocator, as a tensor would, and keep the mappings few."""
    if nbytes < _HUGE_BLOCK or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.empty(nbytes, dtype=torch.uint8).numpy()
    try:
        memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # out of mappings (vm.max_map_count): the allocator's memory, as for a small block
        return torch.empty(nbytes, dtype=torch.uint8).numpy()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            memory.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # a kernel without transparent huge pages: 4 KB pages
            pass
    return memory


def _tensor_over(memory, offset: int, e: _Entry) -> torch.Tensor:
    """The tensor of entry e over memory[offset : offset + e.nbytes] (its storage, in memory order): its
    dtype, shape and strides, a leaf of its own (not a view), keeping `memory` alive."""
    if e.nbytes == 0:
        return torch.empty_strided(e.shape, e.stride, dtype=e.dtype)
    storage = torch.frombuffer(memory, dtype=torch.uint8, count=e.nbytes, offset=offset).untyped_storage()
    return torch.empty(0, dtype=e.dtype).set_(storage, 0, e.shape, e.stride)


def _covers_storage(t: torch.Tensor) -> bool:
    """Whether t's elements are exactly its storage (a dense tensor in a permuted layout, e.g. a transpose)."""
    return (t.storage_offset() == 0 and 0 not in t.stride()
            and t.untyped_storage().nbytes() == t.numel() * t.element_size())


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
