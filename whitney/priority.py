"""A thread's CPU priority lowered for work that should not slow the engine's compute threads (torch-free: the
service's heavy checks and a Ray worker's heavy calls use it).

Lowered means nice LOWERED_NICE, per thread (Linux), which is also how engine/threads.py tells such threads from
the process's own load. Not lower: a Python thread that the kernel keeps off the CPU while it holds the
interpreter lock holds up every other thread of its process, the engine's included. Linux's SCHED_IDLE, which
gave training more of the CPU beside a decoding thread in isolation, made the hostile benchmark worse for that
reason (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import os
import threading

LOWERED_NICE = 10  # nice 10 weighs about 1/10 of nice 0 in Linux's scheduler


def lower_this_thread() -> None:
    """The calling thread at nice LOWERED_NICE (Linux sets it per thread; elsewhere, or where refused, left as it
    is). Idempotent."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LOWERED_NICE)
    except (AttributeError, OSError):
        pass
