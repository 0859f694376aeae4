"""A thread's CPU priority lowered for work that must never slow the engine's compute threads (torch-free: the
service's heavy checks and a Ray worker's call the same).

Lowered means Linux's SCHED_IDLE policy, per thread: such a thread runs only on a core nothing else wants and
gives it up at once. A lower nice alone was not enough: a woken compute thread still waited out the other's time
slice, and the engine's OpenMP threads, meeting at a barrier after every kernel, all waited for that one
(docs/BENCHMARKS.md). The thread is also set to nice LOWERED_NICE, which is how engine/threads.py tells such
threads from the process's own load, and the whole priority where SCHED_IDLE is refused.
"""

from __future__ import annotations

import os
import threading

LOWERED_NICE = 10  # nice 10 weighs about 1/10 of nice 0 in Linux's scheduler


def lower_this_thread() -> None:
    """The calling thread at nice LOWERED_NICE, then SCHED_IDLE (Linux sets both per thread; elsewhere, or where
    refused, left as it is). Idempotent."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, LOWERED_NICE)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass
