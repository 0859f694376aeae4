"""whitney/heap.py against glibc itself, in fresh interpreters: request threads share the heap's freed memory."""

from __future__ import annotations

import subprocess
import sys

import pytest

# Eight threads, each with its first allocation made while all are alive (so each would get its own arena), then
# one at a time allocating and freeing 32 MiB under the server's thresholds (freed memory kept, not unmapped).
# Prints how much the process grew (MiB).
SCRIPT = """
import sys, threading
from whitney import heap
heap._mallopt((heap._M_MMAP_THRESHOLD, heap.KEPT_BYTES), (heap._M_TRIM_THRESHOLD, heap.KEPT_BYTES))
if sys.argv[1] == "shared":
    assert heap.share_arenas()
def rss():
    with open("/proc/self/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024
before, alive, one_at_a_time = rss(), threading.Barrier(8), threading.Lock()
def request_thread():
    small = bytearray(64)
    alive.wait()
    with one_at_a_time:
        body = bytearray(32 << 20)
        body[::4096] = b"x" * len(body[::4096])  # touched: resident
        del body
threads = [threading.Thread(target=request_thread) for _ in range(8)]
[t.start() for t in threads]
[t.join() for t in threads]
print(rss() - before)
"""


def grown_mib(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=120, check=True)
    return float(out.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's arenas")
def test_threads_share_arenas_so_freed_buffers_are_reused_not_kept_per_thread():
    own, shared = grown_mib("own"), grown_mib("shared")
    assert own >= 4 * 32, own  # each thread's arena kept its 32 MiB (the server's request threads did)
    assert shared <= 2 * 32 + 16, shared  # one arena's 32 MiB, reused by each thread in turn
