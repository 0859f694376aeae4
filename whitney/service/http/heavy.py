"""Heavy checks of requests, at a low CPU priority: a custom loss's graph planned, images decoded and processed.

They run before a request is queued, so a bad one is a 4xx now, but they are CPU work the engine's compute
threads would otherwise share their cores with: on a 2-core machine one request thread decoding 4096 x 4096
JPEGs slowed every other tenant's training several times over (bench/hostile.py). So each runs on one of
HEAVY_THREADS threads of their own whose priority is lowered, where the engine's threads come first and the check
takes the time they leave; the request's thread waits for it. Lowered means Linux's SCHED_IDLE policy (a
thread's own): a lower nice alone was not enough, since a woken compute thread still waited out the check's
time slice, and the engine's OpenMP threads, meeting at a barrier after every kernel, all waited for that one
(docs/BENCHMARKS.md). A SCHED_IDLE thread runs only on a core nothing else wants and gives it up at once. The
threads are also at nice HEAVY_NICE, which is how engine/threads.py tells them from the server's own load
(and the whole priority where SCHED_IDLE is refused).
Each is also one of its key's heavy checks (Quotas.validating: at most 2 of a key's at once, its tokens counted).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from whitney.service.store.quotas import Quotas

T = TypeVar("T")
HEAVY_THREADS = 4
HEAVY_NICE = 10  # also the priority where SCHED_IDLE is refused: nice 10 weighs about 1/10 of nice 0

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _lower_priority() -> None:
    """A heavy-check thread's own priority lowered: nice HEAVY_NICE, then SCHED_IDLE (Linux sets both per thread;
    elsewhere, or where refused, left as it is)."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, HEAVY_NICE)
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        pass


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HEAVY_THREADS, thread_name_prefix="whitney-heavy", initializer=_lower_priority)
        return _pool


def run_checked(quotas: Quotas, owner: str, tokens: int, heavy: bool, fn: Callable[..., T], *args) -> T:
    """fn(*args), a check of one of `owner`'s requests whose `tokens` count against its tokens per minute: when
    `heavy`, as one of the key's heavy checks on a low-priority thread (the caller's waits), else right here."""
    with quotas.validating(owner, tokens, heavy):
        return _threads().submit(fn, *args).result() if heavy else fn(*args)
