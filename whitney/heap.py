"""The process's heap, tuned for a server that allocates and frees the same large tensors every call, and whose
many request threads must not each keep their own. Torch-free (ctypes only): the service and the engine both
call it.

glibc's malloc serves each block above its mmap threshold (at most 32 MB by default) with a fresh mmap and
returns it with munmap on free, so every [R, V] logits tensor of a training call (50 MB for 256 tokens of
a 49,152-token vocabulary) is page-faulted in again, page by page, each time: faulting the memory in, not
filling it, is then most of such a tensor's cost (docs/BENCHMARKS.md). `keep_freed_memory` raises the mmap threshold and the trim threshold to
KEPT_BYTES, so freed blocks up to that size stay in the heap for the next call. The cost: up to KEPT_BYTES
of freed memory stays resident after a peak; `malloc_trim(0)` (Engine.delete_run, paging) still returns
it at once.

`share_arenas` caps glibc's malloc arenas at ARENAS. By default each thread that allocates while another holds
an arena gets one of its own, up to 8 per core, and each arena keeps the memory its thread freed (up to the trim
threshold): a request thread that read a 12 MB body or decoded a 4096 x 4096 image keeps those buffers resident
for itself: under the hostile benchmark that was most of the server's memory growth (docs/BENCHMARKS.md). Most of
a Python thread's allocations are made holding the interpreter lock, so sharing adds little waiting. Linux with
glibc only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import sys

KEPT_BYTES = 1 << 30
ARENAS = 2  # the main thread's (the engine's worker loop, in a server) and one every other thread shares
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters (malloc.h)
# glibc's malloc_trim (None elsewhere): freed memory of every thread's arena goes back to the system.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None


def _mallopt(*settings: tuple[int, int]) -> bool:
    """glibc's mallopt for each (parameter, value); True if it took them all (False off Linux, or not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform == "linux" else None
    return mallopt is not None and all([bool(mallopt(param, value)) for param, value in settings])


def share_arenas(arenas: int = ARENAS) -> bool:
    """At most `arenas` malloc arenas in this process from now on (threads share them); True if glibc took it.
    Call it early: an arena made before stays."""
    return _mallopt((_M_ARENA_MAX, arenas))


def keep_freed_memory(kept_bytes: int = KEPT_BYTES) -> bool:
    """Let the heap keep up to `kept_bytes` of freed memory for reuse, in arenas the threads share
    (`share_arenas`); True if glibc took every setting."""
    return _mallopt((_M_MMAP_THRESHOLD, kept_bytes), (_M_TRIM_THRESHOLD, kept_bytes)) and share_arenas()


def release_memory() -> None:
    """Give freed memory back to the system, every arena's (glibc on Linux; elsewhere a no-op): after a run's state
    is dropped, and after a large image was decoded (the heap would otherwise keep its buffers, up to KEPT_BYTES)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
