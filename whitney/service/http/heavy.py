"""Heavy checks of requests, at a low CPU priority: a custom loss's graph planned, images decoded and processed.

They run before a request is queued, so a bad one is a 4xx now, but they are CPU work the engine's compute
threads would otherwise share their cores with: on a 2-core machine one request thread decoding 4096 x 4096
JPEGs slowed every other tenant's training several times over (bench/hostile.py). So each runs on one of
HEAVY_THREADS threads of their own at a lowered CPU priority (whitney/priority.py: nice 10), where the
engine's threads come first and the check takes the time they leave; the request's thread waits for it.
Each is also one of its key's heavy checks (Quotas.validating: at most 2 of a key's at once, its tokens counted).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from whitney.priority import lower_this_thread
from whitney.service.store.quotas import Quotas

T = TypeVar("T")
HEAVY_THREADS = 4

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(HEAVY_THREADS, thread_name_prefix="whitney-heavy", initializer=lower_this_thread)
        return _pool


def run_checked(quotas: Quotas, owner: str, tokens: int, heavy: bool, fn: Callable[..., T], *args) -> T:
    """fn(*args), a check of one of `owner`'s requests whose `tokens` count against its tokens per minute: when
    `heavy`, as one of the key's heavy checks on a low-priority thread (the caller's waits), else right here."""
    with quotas.validating(owner, tokens, heavy):
        return _threads().submit(fn, *args).result() if heavy else fn(*args)
