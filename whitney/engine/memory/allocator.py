"""The process's heap, tuned for a server that allocates and frees the same large tensors every call.

glibc's malloc serves each block above its mmap threshold (at most 32 MB by default) with a fresh mmap and
returns it with munmap on free, so every [R, V] logits tensor of a training call (50 MB for 256 tokens of
a 49,152-token vocabulary) is page-faulted in again, page by page, each time: faulting the memory in, not
filling it, is then most of such a tensor's cost (docs/BENCHMARKS.md). `keep_freed_memory` raises the mmap threshold and the trim threshold to
KEPT_BYTES, so freed blocks up to that size stay in the heap for the next call. The cost: up to KEPT_BYTES
of freed memory stays resident after a peak; `malloc_trim(0)` (Engine.delete_run, paging) still returns
it at once. Linux with glibc only; elsewhere a no-op.
"""

from __future__ import annotations

import ctypes
import sys

KEPT_BYTES = 1 << 30
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
# glibc's malloc_trim (None elsewhere): freed memory of every thread's arena goes back to the system.
_MALLOC_TRIM = getattr(ctypes.CDLL(None), "malloc_trim", None) if sys.platform == "linux" else None


def keep_freed_memory(kept_bytes: int = KEPT_BYTES) -> bool:
    """Let the heap keep up to `kept_bytes` of freed memory for reuse; True if glibc took both settings."""
    if sys.platform != "linux":
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:  # not glibc (musl)
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, kept_bytes)) and bool(mallopt(_M_TRIM_THRESHOLD, kept_bytes))


def release_memory() -> None:
    """Give freed memory back to the system, every thread's arena's (glibc on Linux; elsewhere a no-op): after a
    run's state is dropped, and after a request thread decoded a large image (each thread's arena would otherwise
    keep its buffers)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)
