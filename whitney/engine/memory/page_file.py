"""Page files (engine/paging.py): a run's tensors written to a file and read back bitwise equal.

A file is the tensors' bytes one after another, each at an offset that is a multiple of 64 bytes, written
with a few `writev` calls; what each one is stays in memory (`PageEntry`s, kept by the pager: one `Layout`
for every file of the same layout), so the file needs no header. A paged-out run has two: its adapter with
the rest, and its AdamW moments.

Integrity: a checksum of a file's tensor bytes (in file order, padding left out) is taken while it is written
and kept in memory with its entries; reading it back checks the bytes it read against it, and that none is
missing, before any tensor read is used (`read_file`'s caller uses none until the last one is read): a file
damaged, truncated or removed is `PageFileLost`, never numbers from damaged bytes. The checksum's cost:
docs/BENCHMARKS.md's notes.

Reading back: the tensors of one block (the adapter, each AdamW moment, the gradients, one stage, one
version: tensors that are dropped together) are read with one `readinto` into memory of their own and each
tensor is built over its bytes (`torch.frombuffer`, then `set_` to its shape and strides: a leaf, not a
view). A block of 2 MB or more gets an anonymous mapping advised into 2 MB pages (`MADV_HUGEPAGE`): most of
a page-in was the kernel faulting fresh memory in 4 KB at a time, which 2 MB pages make much cheaper
(`_fresh_memory`). The mapping goes back to the system (munmap) when the block's last tensor is dropped. The
file's cached pages are freed by closing it on a thread of its own. Page-in and page-out times:
docs/BENCHMARKS.md.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from whitney.engine.training.optim import OptimizerState

_ALIGN = 64  # bytes: every tensor starts at a multiple of this in its file and in memory
_HUGE_BLOCK = 2 * 2**20  # blocks of at least this many bytes get memory of their own in 2 MB pages
_IOV_MAX = 1024  # buffers per writev (Linux's IOV_MAX)
_FLUSH_BYTES = 64 * 2**20  # a page-out writes what it has gathered at this size (bounds copies off a GPU)
_ZEROS = bytes(_ALIGN)


class _checksum:
    """A CRC-32 of a page file's bytes, taken piece by piece (`update(buffer)`, then `digest()`): it catches any
    burst of errors up to 32 bits and a byte left out, at about 2.6x the speed of a SHA-256 here (which guards
    against tampering, not needed for a file only this process writes: docs/BENCHMARKS.md's notes)."""

    __slots__ = ("value",)

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)  # releases the GIL over large buffers

    def digest(self) -> bytes:
        return self.value.to_bytes(4, "little")


class PageFileLost(Exception):
    """A page file could not be read back whole and as written: missing, truncated, or its bytes differ from
    those written (its checksum). The message says which, and names no path."""


@dataclass(frozen=True)
class PageEntry:
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


class Layout(list):
    """A page file's entries, in order; never changed once made. Equal layouts are one object (`write_file`
    shares them; a list subclass, since a tuple cannot be weakly referred to)."""


@dataclass
class PagedMoments:
    """AdamW's state in a file of its own: a paged-out run's, or a paged-in run's until its optimizer is first
    used (`Run.optimizer` reads it then, through `reader`: the pager's, which counts and times the read)."""

    path: Path
    entries: Layout
    step: int
    nbytes: int
    reader: Callable[[PagedMoments, torch.device], OptimizerState]
    digest: bytes  # the checksum of its tensors' bytes (`write_file`)
    run_id: str

    def read(self, device: torch.device) -> OptimizerState:
        return self.reader(self, device)

    def discard(self) -> None:
        self.path.unlink(missing_ok=True)


# Every layout some paged run keeps, by its entries: runs of one adapter config in the same state write the same
# entries (names, shapes, offsets), so a thousand paged runs keep one list of them, not a thousand (a list per
# run costs each paged run hundreds of entries' memory). Dropped with the last run keeping it.
_LAYOUTS: "weakref.WeakValueDictionary[tuple[PageEntry, ...], Layout]" = weakref.WeakValueDictionary()
_LAYOUTS_LOCK = threading.Lock()


def _shared(entries: list[PageEntry]) -> Layout:
    key = tuple(entries)
    with _LAYOUTS_LOCK:
        layout = _LAYOUTS.get(key)
        if layout is None:
            layout = _LAYOUTS[key] = Layout(key)
    return layout


def write_file(path: Path, groups) -> tuple[Layout, int, bytes]:
    """Write the tensors of `groups` ((kind, group, (name, tensor) pairs) each) to a new file at `path`, each at
    a multiple of _ALIGN, with a few writevs; (what is where, shared with every equal file's; their bytes; the
    checksum of their bytes, which `read_file` checks). No file is left if it fails."""
    entries, total, checksum = [], 0, _checksum()
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
                    entries.append(PageEntry(kind, group, name, tuple(t.shape), t.stride(), t.dtype,
                                          requires_grad, nbytes, offset))
                    data = flat.view(torch.uint8).numpy()  # [nbytes]
                    checksum.update(data)
                    pending.append(data)
                    offset, pending_bytes, total = offset + nbytes, pending_bytes + nbytes, total + nbytes
                    if pending_bytes >= _FLUSH_BYTES or len(pending) >= _IOV_MAX:
                        _write(f, pending)
                        pending, pending_bytes = [], 0
            _write(f, pending)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    return _shared(entries), total, checksum.digest()


def read_file(path: Path, entries: list[PageEntry], device: torch.device, digest: bytes):
    """Each entry's tensor (on `device`, its requires_grad as it was) with its entry, read from the file at
    `path`, which is deleted once read. The bytes are checked against `digest` (`write_file`'s) after the last
    tensor and before this generator ends: a caller uses none of the tensors until it has ended, and a file
    missing, truncated or damaged raises `PageFileLost` (an OSError other than a missing file is raised as is)."""
    try:
        f = open(path, "rb", buffering=0)
    except FileNotFoundError:
        raise PageFileLost("its page file is missing") from None
    try:
        for t, e in _read_blocks(f, entries, digest):
            yield t.to(device).requires_grad_(e.requires_grad), e
    except BaseException:
        f.close()
        raise
    if os.name == "nt":  # an open file cannot be deleted there
        f.close()
    # The name goes now; the file's pages in the cache are freed when it is closed (which takes time in
    # proportion to the file), which another thread does, off the engine's.
    path.unlink(missing_ok=True)
    threading.Thread(target=f.close, name="whitney-page-file-close", daemon=True).start()


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


def _read_blocks(f, entries: list[PageEntry], digest: bytes):
    """Each entry's tensor (on the CPU) with its entry, in order, read from file f one block at a time: the
    consecutive entries of one kind and group are dropped together, so they share memory of their own. After
    the last one, the checksum of the bytes read is compared with `digest` (PageFileLost if they differ)."""
    checksum = _checksum()
    for _, same in itertools.groupby(entries, key=lambda e: (e.kind, e.group)):
        block = list(same)
        first, last = block[0].offset, block[-1].offset + block[-1].nbytes
        memory = _fresh_memory(last - first)
        f.seek(first)
        view, done = memoryview(memory), 0
        while done < len(view):  # one readinto, more only past the 2 GB a Linux read returns at most
            n = f.readinto(view[done:])
            if not n:
                raise PageFileLost("its page file is truncated")
            done += n
        for e in block:
            checksum.update(view[e.offset - first:e.offset - first + e.nbytes])
        for e in block:
            yield _tensor_over(memory, e.offset - first, e), e
    if checksum.digest() != digest:
        raise PageFileLost("its page file's bytes differ from those written (its checksum does not match)")


def _fresh_memory(nbytes: int):
    """A writable buffer of nbytes, 64-byte aligned. From 2 MB up an anonymous mapping of its own, advised
    into 2 MB pages (a 2 MB page is one fault and one zeroing where 4 KB pages are 512); unmapped once nothing
    refers to it (the tensors built over it hold it). Smaller blocks come from torch's allocator, as a tensor would, and keep the mappings few."""
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


def _tensor_over(memory, offset: int, e: PageEntry) -> torch.Tensor:
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
